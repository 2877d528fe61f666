//! The instance's NIC: QEMU arguments, and for bridge mode the tap device
//! Keel creates on the bridge before QEMU starts and removes at cleanup.
//!
//! Every VM has one `virtio-net-pci` NIC with the MAC from its spec. Two
//! backends:
//! - *user* (default): user-mode networking by a `passt` process of the
//!   instance's ([`super::passt`]), over a socketpair. No privileges; the
//!   guest gets the host's address by DHCP and no way into the host's
//!   loopback; passt's listeners publish host ports.
//! - *bridge*: a persistent tap (`TUNSETIFF` + `TUNSETPERSIST`), attached to
//!   the named bridge (`SIOCBRADDIF`) and brought up, all by ioctl from
//!   Keel: QEMU runs under `-sandbox …spawn=deny`, so it could not run
//!   helper scripts (`script=no,downscript=no`), and Keel would rather not
//!   shell out to `ip` for something the kernel offers in four calls. QEMU
//!   opens the tap by name. The tap's name is a function of the instance
//!   id, so cleanup (even by a restarted Keel) knows what to remove without
//!   a record.

use std::io;

use keel_api::{MacAddr, NetworkMode, NetworkSpec, PortForward};

/// What the command line needs to attach the NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicPlan {
    pub mac: MacAddr,
    pub backend: Backend,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    User { forwards: Vec<PortForward> },
    Tap { tap: String, bridge: String },
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("spec.network.mac {0:?} is not a valid MAC")]
    Mac(String),
    #[error("spec.network: bridge mode without a bridge")]
    NoBridge,
    #[error("bridge {bridge} not found on this node ({reason}); create it or pick another with --network bridge=NAME")]
    BridgeMissing { bridge: String, reason: String },
    #[error("{bridge} is not a Linux bridge ({reason})")]
    NotABridge { bridge: String, reason: String },
    #[error("tap {tap}: {op}: {source}")]
    Tap {
        tap: String,
        op: &'static str,
        source: io::Error,
    },
}

impl NicPlan {
    /// The plan for `spec` (MAC already resolved by the caller: a domain
    /// spec always carries one) for `instance` of `vm`.
    pub fn new(vm: &str, instance: &str, spec: &NetworkSpec) -> Result<NicPlan, NetError> {
        let mac = spec
            .mac_addr()
            // A launch record from a build that did not know NICs: the
            // VM's derived MAC, as the controller would have sent.
            .or_else(|| spec.mac.is_none().then(|| MacAddr::derived(vm)))
            .ok_or_else(|| NetError::Mac(spec.mac.clone().unwrap_or_default()))?;
        let backend = match spec.mode {
            NetworkMode::User => Backend::User {
                forwards: spec.publish.clone(),
            },
            NetworkMode::Bridge => Backend::Tap {
                tap: tap_name(instance),
                bridge: spec.bridge.clone().ok_or(NetError::NoBridge)?,
            },
        };
        Ok(NicPlan { mac, backend })
    }

    /// `-netdev` and `-device` for the NIC. Every value here was validated
    /// (names, addresses, ports), so nothing needs QEMU's comma escaping.
    pub fn args(&self) -> Vec<String> {
        let netdev = match &self.backend {
            // passt's end of the socketpair is at a fixed descriptor; the
            // published ports are passt's arguments, not QEMU's.
            Backend::User { .. } => format!(
                "stream,id=net0,server=off,addr.type=fd,addr.str={}",
                super::passt::QEMU_NET_FD
            ),
            Backend::Tap { tap, .. } => {
                format!("tap,id=net0,ifname={tap},script=no,downscript=no")
            }
        };
        // romfile= (none): no iPXE option ROM. Keel never boots from the
        // network, and the ROM's file is one more thing that must exist.
        vec![
            "-netdev".into(),
            netdev,
            "-device".into(),
            format!("virtio-net-pci,netdev=net0,mac={},romfile=", self.mac),
        ]
    }

    /// Creates what the backend needs on the host before QEMU starts: for
    /// bridge mode the tap, on its bridge and up. Undone by [`release`].
    pub fn prepare(&self) -> Result<(), NetError> {
        match &self.backend {
            Backend::User { .. } => Ok(()),
            Backend::Tap { tap, bridge } => {
                // First, so a missing bridge leaves no tap behind.
                ifindex(bridge).map_err(|e| NetError::BridgeMissing {
                    bridge: bridge.clone(),
                    reason: e.to_string(),
                })?;
                let tap_err = |op, source| NetError::Tap {
                    tap: tap.clone(),
                    op,
                    source,
                };
                tun_persist(tap, true).map_err(|e| tap_err("create", e))?;
                let attached = ifindex(tap)
                    .map_err(|e| tap_err("look up", e))
                    .and_then(|index| {
                        bridge_add_if(bridge, index).map_err(|e| NetError::NotABridge {
                            bridge: bridge.clone(),
                            reason: e.to_string(),
                        })
                    })
                    .and_then(|()| {
                        // The tap takes the bridge's MTU, so the guest's
                        // frames fit the other ports.
                        if let Ok(mtu) = get_mtu(bridge) {
                            let _ = set_mtu(tap, mtu);
                        }
                        set_up(tap).map_err(|e| tap_err("bring up", e))
                    });
                if let Err(e) = attached {
                    let _ = delete_tap(tap);
                    return Err(e);
                }
                Ok(())
            }
        }
    }
}

/// The host interface name of `instance`'s tap: `kt` and 13 hex digits of a
/// hash of the instance id (interface names hold 15 bytes; instance ids
/// are longer). Distinct instances of a host get distinct names.
pub fn tap_name(instance: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in instance.as_bytes() {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("kt{:013x}", hash & ((1 << 52) - 1))
}

/// Removes `instance`'s tap, if there is one. Absent is success: cleanup
/// runs for user-mode instances too, and may run twice.
pub fn release(instance: &str) -> Result<(), NetError> {
    let tap = tap_name(instance);
    match ifindex(&tap) {
        Ok(_) => delete_tap(&tap),
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
        Err(source) => Err(NetError::Tap {
            tap,
            op: "look up",
            source,
        }),
    }
}

/// Whether the tap of `instance` exists (tests).
pub fn tap_exists(instance: &str) -> bool {
    ifindex(&tap_name(instance)).is_ok()
}

fn delete_tap(tap: &str) -> Result<(), NetError> {
    // Clearing persistence on the last close deletes the device (and takes
    // it off its bridge). A QEMU still holding it keeps it until it exits.
    tun_persist(tap, false).map_err(|source| NetError::Tap {
        tap: tap.to_string(),
        op: "delete",
        source,
    })
}

// --- ioctls --------------------------------------------------------------

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
const TUNSETOWNER: libc::c_ulong = 0x4004_54cc;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const SIOCBRADDIF: libc::c_ulong = 0x89a2;

/// `struct ifreq`: the name, then a 24-byte union of which we use the
/// flags (short) and the index/MTU (int).
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    data: [u8; 24],
}

impl IfReq {
    fn new(name: &str) -> io::Result<IfReq> {
        let bytes = name.as_bytes();
        if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is not an interface name"),
            ));
        }
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            data: [0; 24],
        };
        req.name[..bytes.len()].copy_from_slice(bytes);
        Ok(req)
    }
    fn set_short(&mut self, v: libc::c_short) {
        self.data[..2].copy_from_slice(&v.to_ne_bytes());
    }
    fn short(&self) -> libc::c_short {
        libc::c_short::from_ne_bytes([self.data[0], self.data[1]])
    }
    fn set_int(&mut self, v: libc::c_int) {
        self.data[..4].copy_from_slice(&v.to_ne_bytes());
    }
    fn int(&self) -> libc::c_int {
        libc::c_int::from_ne_bytes([self.data[0], self.data[1], self.data[2], self.data[3]])
    }
}

struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn inet_socket() -> io::Result<Fd> {
    // SAFETY: plain socket(2); the fd is owned by the returned Fd.
    check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) }).map(Fd)
}

fn ioctl(fd: &Fd, request: libc::c_ulong, req: &mut IfReq) -> io::Result<()> {
    // SAFETY: every request used here takes a `struct ifreq`, which IfReq
    // lays out (40 bytes), and the kernel writes only within it.
    check(unsafe { libc::ioctl(fd.0, request as _, req as *mut IfReq) }).map(|_| ())
}

/// Creates (or re-attaches to) tap `name` and sets its persistence; with
/// `persist == false` the device goes away once this descriptor closes.
fn tun_persist(name: &str, persist: bool) -> io::Result<()> {
    let path = c"/dev/net/tun";
    // SAFETY: a NUL-terminated path; the fd is owned by Fd.
    let fd = Fd(check(unsafe {
        libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC)
    })?);
    let mut req = IfReq::new(name)?;
    req.set_short(IFF_TAP | IFF_NO_PI);
    ioctl(&fd, TUNSETIFF, &mut req)?;
    if persist {
        // Owned by Keel's user: QEMU, which runs as that user without any
        // capability, may then attach to it (a tap without an owner takes
        // CAP_NET_ADMIN to open).
        // SAFETY: TUNSETOWNER takes a uid by value; geteuid has no
        // preconditions.
        check(unsafe { libc::ioctl(fd.0, TUNSETOWNER as _, libc::geteuid() as libc::c_ulong) })?;
    }
    // SAFETY: TUNSETPERSIST takes an int by value.
    check(unsafe { libc::ioctl(fd.0, TUNSETPERSIST as _, libc::c_int::from(persist)) })?;
    Ok(())
}

fn ifindex(name: &str) -> io::Result<libc::c_int> {
    let sock = inet_socket()?;
    let mut req = IfReq::new(name)?;
    ioctl(&sock, libc::SIOCGIFINDEX, &mut req)?;
    Ok(req.int())
}

fn bridge_add_if(bridge: &str, index: libc::c_int) -> io::Result<()> {
    let sock = inet_socket()?;
    let mut req = IfReq::new(bridge)?;
    req.set_int(index);
    ioctl(&sock, SIOCBRADDIF, &mut req)
}

fn set_up(name: &str) -> io::Result<()> {
    let sock = inet_socket()?;
    let mut req = IfReq::new(name)?;
    ioctl(&sock, libc::SIOCGIFFLAGS, &mut req)?;
    let flags = req.short() | libc::IFF_UP as libc::c_short;
    req.set_short(flags);
    ioctl(&sock, libc::SIOCSIFFLAGS, &mut req)
}

fn get_mtu(name: &str) -> io::Result<libc::c_int> {
    let sock = inet_socket()?;
    let mut req = IfReq::new(name)?;
    ioctl(&sock, libc::SIOCGIFMTU, &mut req)?;
    Ok(req.int())
}

fn set_mtu(name: &str, mtu: libc::c_int) -> io::Result<()> {
    let sock = inet_socket()?;
    let mut req = IfReq::new(name)?;
    req.set_int(mtu);
    ioctl(&sock, libc::SIOCSIFMTU, &mut req)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::Protocol;

    fn spec(mode: NetworkMode) -> NetworkSpec {
        NetworkSpec {
            mac: Some("52:54:00:12:34:56".into()),
            mode,
            bridge: (mode == NetworkMode::Bridge).then(|| "br0".into()),
            publish: vec![],
        }
    }

    #[test]
    fn user_mode_is_passts_socket_and_publishes_through_passt() {
        let mut s = spec(NetworkMode::User);
        s.publish = vec![
            PortForward {
                host_address: "127.0.0.1".into(),
                host_port: 2222,
                guest_port: 22,
                protocol: Protocol::Tcp,
            },
            PortForward {
                host_address: "0.0.0.0".into(),
                host_port: 5353,
                guest_port: 53,
                protocol: Protocol::Udp,
            },
        ];
        let plan = NicPlan::new("web", "web-1", &s).unwrap();
        assert_eq!(
            plan.backend,
            Backend::User {
                forwards: s.publish.clone()
            }
        );
        assert_eq!(
            plan.args(),
            [
                "-netdev",
                "stream,id=net0,server=off,addr.type=fd,addr.str=3",
                "-device",
                "virtio-net-pci,netdev=net0,mac=52:54:00:12:34:56,romfile="
            ]
        );
    }

    #[test]
    fn bridge_mode_opens_the_instances_tap_without_scripts() {
        let plan = NicPlan::new("web", "web-1", &spec(NetworkMode::Bridge)).unwrap();
        let tap = tap_name("web-1");
        assert_eq!(
            plan.backend,
            Backend::Tap {
                tap: tap.clone(),
                bridge: "br0".into()
            }
        );
        assert_eq!(
            plan.args()[1],
            format!("tap,id=net0,ifname={tap},script=no,downscript=no")
        );
    }

    #[test]
    fn tap_names_fit_ifnamsiz_and_differ_per_instance() {
        let long = "v".repeat(keel_api::name::MAX_NAME_LEN);
        for i in ["web-1", "web-2", long.as_str()] {
            let n = tap_name(i);
            assert_eq!(n.len(), 15, "{n}");
            keel_api::network::validate_ifname("tap", &n).unwrap();
        }
        assert_ne!(tap_name("web-1"), tap_name("web-2"));
    }

    #[test]
    fn a_spec_without_a_mac_gets_the_vms_derived_one() {
        let mut s = spec(NetworkMode::User);
        s.mac = None;
        let plan = NicPlan::new("web", "web-1", &s).unwrap();
        assert_eq!(plan.mac, MacAddr::derived("web"));
        s.mac = Some("zz".into());
        assert!(NicPlan::new("web", "web-1", &s).is_err());
    }

    #[test]
    fn a_missing_bridge_fails_naming_it_and_leaves_no_tap() {
        let mut s = spec(NetworkMode::Bridge);
        s.bridge = Some("kbr-missing0".into());
        let plan = NicPlan::new("web", "web-nobridge-1", &s).unwrap();
        let err = plan.prepare().unwrap_err();
        assert!(matches!(err, NetError::BridgeMissing { .. }), "{err}");
        assert!(err.to_string().contains("kbr-missing0"), "{err}");
        assert!(!tap_exists("web-nobridge-1"));
        release("web-nobridge-1").unwrap();
    }
}
