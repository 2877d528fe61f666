//! A VM's network: one virtio NIC with a stable MAC, on QEMU's user-mode
//! network (with published ports) or on a Linux bridge through a tap.
//!
//! The MAC is part of the VM's identity: assigned once, when the VM is
//! created (the API fills it in when the request has none), kept in the spec
//! across restarts, migrations and spec replacements. A guest OS names its
//! interface configuration and DHCP leases after it, so a new MAC per boot
//! would make a "new" machine each time. Records written before MACs existed
//! get one derived from the VM's name ([`MacAddr::derived`]): stable too.

use std::fmt;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::ValidationError;

/// At most this many published ports per VM.
pub const MAX_PUBLISH: usize = 64;

/// Linux interface names hold 15 bytes (IFNAMSIZ less the NUL).
pub const MAX_IFNAME_LEN: usize = 15;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NetworkSpec {
    /// `aa:bb:cc:dd:ee:ff`, unicast. `None` only in a request (the API
    /// assigns one) or a record from before MACs were kept (derived from
    /// the name on decode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    #[serde(default)]
    pub mode: NetworkMode,
    /// For `mode: Bridge`: the Linux bridge on the node the tap joins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// Host ports forwarded into the guest (user-mode networking only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub publish: Vec<PortForward>,
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// QEMU's user-mode network (slirp): needs no privileges; the guest
    /// gets 10.0.2.15 by DHCP and reaches out through the host's stack;
    /// inbound only through `publish`.
    #[default]
    User,
    /// A tap device Keel creates on `bridge`: the guest is on that L2
    /// network like any host on it.
    Bridge,
}

impl fmt::Display for NetworkMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NetworkMode::User => "user",
            NetworkMode::Bridge => "bridge",
        })
    }
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    #[default]
    Tcp,
    Udp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        })
    }
}

/// `host_address:host_port` on the node → `guest_port` in the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PortForward {
    /// IPv4 address on the node to listen on; loopback unless asked.
    #[serde(default = "default_host_address")]
    pub host_address: String,
    pub host_port: u16,
    pub guest_port: u16,
    #[serde(default)]
    pub protocol: Protocol,
}

pub fn default_host_address() -> String {
    Ipv4Addr::LOCALHOST.to_string()
}

impl fmt::Display for PortForward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}/{}",
            self.host_address, self.host_port, self.guest_port, self.protocol
        )
    }
}

impl std::str::FromStr for PortForward {
    type Err = String;

    /// `[ADDR:]HOSTPORT:GUESTPORT[/tcp|/udp]`, as `--publish` takes it.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (ports, protocol) = match s.rsplit_once('/') {
            Some((p, "tcp")) => (p, Protocol::Tcp),
            Some((p, "udp")) => (p, Protocol::Udp),
            Some((_, other)) => return Err(format!("protocol {other:?} is not tcp or udp")),
            None => (s, Protocol::Tcp),
        };
        let parts: Vec<&str> = ports.split(':').collect();
        let (addr, host, guest) = match parts.as_slice() {
            [host, guest] => (default_host_address(), *host, *guest),
            [addr, host, guest] => (addr.to_string(), *host, *guest),
            _ => return Err(format!("{s:?} is not [ADDR:]HOSTPORT:GUESTPORT[/tcp|/udp]")),
        };
        let port = |what: &str, p: &str| -> Result<u16, String> {
            match p.parse::<u16>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("{what} {p:?} is not a port in 1..=65535")),
            }
        };
        let forward = PortForward {
            host_address: addr,
            host_port: port("host port", host)?,
            guest_port: port("guest port", guest)?,
            protocol,
        };
        forward.validate("publish").map_err(|e| e.message)?;
        Ok(forward)
    }
}

impl PortForward {
    /// What it listens on, `address:port/protocol` (the guest side left
    /// out): the part two forwards on one host must not share.
    pub fn listener(&self) -> String {
        format!("{}:{}/{}", self.host_address, self.host_port, self.protocol)
    }

    /// Whether the two cannot both listen on one host: the same port and
    /// protocol on the same address, or either on every address (0.0.0.0).
    pub fn clashes_with(&self, other: &PortForward) -> bool {
        self.host_port == other.host_port
            && self.protocol == other.protocol
            && (self.host_address == other.host_address
                || self.host_address == "0.0.0.0"
                || other.host_address == "0.0.0.0")
    }

    fn validate(&self, field: &str) -> Result<(), ValidationError> {
        match self.host_address.parse::<Ipv4Addr>() {
            Ok(a) if a.is_multicast() || a.is_broadcast() => Err(ValidationError::new(
                format!("{field}.host_address"),
                format!("{} is not a unicast address", self.host_address),
            )),
            Ok(_) => Ok(()),
            // QEMU 7.2's user-mode network forwards from IPv4 only.
            Err(_) => Err(ValidationError::new(
                format!("{field}.host_address"),
                format!("{:?} is not an IPv4 address", self.host_address),
            )),
        }?;
        for (name, port) in [
            ("host_port", self.host_port),
            ("guest_port", self.guest_port),
        ] {
            if port == 0 {
                return Err(ValidationError::new(
                    format!("{field}.{name}"),
                    "0 is not a port; use 1..=65535",
                ));
            }
        }
        Ok(())
    }
}

/// A MAC address, six octets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// A locally administered unicast address (`52:54:` as QEMU and
    /// libvirt use, then 32 random bits: a collision on one bridge is
    /// unlikely below tens of thousands of VMs).
    pub fn from_random(bytes: [u8; 4]) -> MacAddr {
        MacAddr([0x52, 0x54, bytes[0], bytes[1], bytes[2], bytes[3]])
    }

    /// The MAC of a VM whose record predates assigned MACs: a function of
    /// its name alone, so every node and every restart agrees on it.
    pub fn derived(vm: &str) -> MacAddr {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for b in b"keel-mac:".iter().chain(vm.as_bytes()) {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        let h = hash.to_be_bytes();
        MacAddr::from_random([h[0] ^ h[4], h[1] ^ h[5], h[2] ^ h[6], h[3] ^ h[7]])
    }

    pub fn is_unicast(&self) -> bool {
        self.0[0] & 1 == 0
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            o[0], o[1], o[2], o[3], o[4], o[5]
        )
    }
}

impl std::str::FromStr for MacAddr {
    type Err = String;

    /// Six hex octets separated by `:` (or `-`), any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let sep = if s.contains('-') { '-' } else { ':' };
        let parts: Vec<&str> = s.split(sep).collect();
        if parts.len() != 6 {
            return Err(format!("{s:?} is not six octets like 52:54:00:12:34:56"));
        }
        let mut out = [0u8; 6];
        for (o, p) in out.iter_mut().zip(&parts) {
            if p.len() != 2 {
                return Err(format!("{s:?}: octet {p:?} is not two hex digits"));
            }
            *o = u8::from_str_radix(p, 16)
                .map_err(|_| format!("{s:?}: octet {p:?} is not two hex digits"))?;
        }
        let mac = MacAddr(out);
        if !mac.is_unicast() {
            return Err(format!(
                "{s:?} is a multicast address (lowest bit of the first octet set)"
            ));
        }
        if out == [0; 6] {
            return Err(format!("{s:?} is the all-zero address"));
        }
        Ok(mac)
    }
}

impl NetworkSpec {
    /// The NIC's MAC, canonical. Only valid specs have one that parses.
    pub fn mac_addr(&self) -> Option<MacAddr> {
        self.mac.as_deref().and_then(|m| m.parse().ok())
    }

    /// Checks every field, naming it (`spec.network.…`).
    pub fn validate(&self) -> Result<(), ValidationError> {
        if let Some(mac) = &self.mac {
            mac.parse::<MacAddr>()
                .map_err(|e| ValidationError::new("spec.network.mac", e))?;
        }
        match (self.mode, &self.bridge) {
            (NetworkMode::Bridge, None) => {
                return Err(ValidationError::new(
                    "spec.network.bridge",
                    "bridge mode needs the name of a Linux bridge on the node",
                ))
            }
            (NetworkMode::Bridge, Some(bridge)) => validate_ifname("spec.network.bridge", bridge)?,
            (NetworkMode::User, Some(_)) => {
                return Err(ValidationError::new(
                    "spec.network.bridge",
                    "only for mode bridge (user-mode networking has no bridge)",
                ))
            }
            (NetworkMode::User, None) => {}
        }
        if !self.publish.is_empty() && self.mode != NetworkMode::User {
            return Err(ValidationError::new(
                "spec.network.publish",
                "published ports are for user-mode networking; on a bridge the guest has its own address",
            ));
        }
        if self.publish.len() > MAX_PUBLISH {
            return Err(ValidationError::new(
                "spec.network.publish",
                format!("{} forwards; at most {MAX_PUBLISH}", self.publish.len()),
            ));
        }
        for (i, p) in self.publish.iter().enumerate() {
            let field = format!("spec.network.publish[{i}]");
            p.validate(&field)?;
            // One listener per host port and protocol: QEMU would fail the
            // whole start on the second bind. Any address overlaps 0.0.0.0.
            let clash = self.publish[..i].iter().find(|q| q.clashes_with(p));
            if let Some(q) = clash {
                return Err(ValidationError::new(
                    format!("{field}.host_port"),
                    format!(
                        "host port {}/{} is already published ({q})",
                        p.host_port, p.protocol
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A Linux interface name: 1..=15 bytes, no `/`, whitespace or `:`, and
/// (since it goes into QEMU options) no `,` or `=`.
pub fn validate_ifname(field: &str, name: &str) -> Result<(), ValidationError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_IFNAME_LEN
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ValidationError::new(
            field,
            format!(
                "{name:?} is not an interface name (1..={MAX_IFNAME_LEN} of a-z, A-Z, 0-9, '-', '_', '.')"
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_parses_the_cli_forms() {
        let p: PortForward = "8080:80".parse().unwrap();
        assert_eq!(p.to_string(), "127.0.0.1:8080:80/tcp");
        let p: PortForward = "0.0.0.0:5353:53/udp".parse().unwrap();
        assert_eq!(
            (p.host_port, p.guest_port, p.protocol),
            (5353, 53, Protocol::Udp)
        );
        for bad in [
            "80",
            "0:80",
            "8080:0",
            "8080:70000",
            "x:80",
            "1:2:3:4",
            "8080:80/sctp",
            "::1:8080:80",
            "224.0.0.1:8080:80",
            "localhost:8080:80",
        ] {
            assert!(bad.parse::<PortForward>().is_err(), "{bad}");
        }
    }

    #[test]
    fn macs_are_validated_and_canonical() {
        let m: MacAddr = "52:54:00:AB:cd:01".parse().unwrap();
        assert_eq!(m.to_string(), "52:54:00:ab:cd:01");
        assert_eq!("52-54-00-ab-cd-01".parse::<MacAddr>().unwrap(), m);
        for bad in [
            "01:00:5e:00:00:01",
            "ff:ff:ff:ff:ff:ff",
            "00:00:00:00:00:00",
            "52:54:00:ab:cd",
            "52:54:00:ab:cd:01:02",
            "5254.00ab.cd01",
            "52:54:00:ab:cd:g1",
            "52:54:00:ab:cd:1",
        ] {
            assert!(bad.parse::<MacAddr>().is_err(), "{bad}");
        }
        assert!(MacAddr::from_random([0xff; 4]).is_unicast());
    }

    #[test]
    fn derived_macs_are_stable_unicast_and_differ_by_name() {
        let a = MacAddr::derived("web");
        assert_eq!(a, MacAddr::derived("web"));
        assert_ne!(a, MacAddr::derived("db"));
        assert!(a.is_unicast());
        assert_eq!(a.to_string().len(), 17);
        // Fixed forever: records from before MACs were kept rely on it.
        assert_eq!(a.to_string(), MacAddr::derived("web").to_string());
    }

    #[test]
    fn validation_names_the_field() {
        let field = |n: NetworkSpec| n.validate().unwrap_err().field;
        let fwd = |addr: &str, port: u16| PortForward {
            host_address: addr.into(),
            host_port: port,
            guest_port: 22,
            protocol: Protocol::Tcp,
        };
        assert_eq!(
            field(NetworkSpec {
                mac: Some("01:00:00:00:00:01".into()),
                ..Default::default()
            }),
            "spec.network.mac"
        );
        assert_eq!(
            field(NetworkSpec {
                mode: NetworkMode::Bridge,
                ..Default::default()
            }),
            "spec.network.bridge"
        );
        assert_eq!(
            field(NetworkSpec {
                mode: NetworkMode::Bridge,
                bridge: Some("a-very-long-bridge-name".into()),
                ..Default::default()
            }),
            "spec.network.bridge"
        );
        assert_eq!(
            field(NetworkSpec {
                mode: NetworkMode::Bridge,
                bridge: Some("br0".into()),
                publish: vec![fwd("127.0.0.1", 2222)],
                ..Default::default()
            }),
            "spec.network.publish"
        );
        assert_eq!(
            field(NetworkSpec {
                publish: vec![fwd("127.0.0.1", 2222), fwd("127.0.0.1", 2222)],
                ..Default::default()
            }),
            "spec.network.publish[1].host_port"
        );
        assert_eq!(
            field(NetworkSpec {
                publish: vec![fwd("127.0.0.1", 2222), fwd("0.0.0.0", 2222)],
                ..Default::default()
            }),
            "spec.network.publish[1].host_port"
        );
        assert_eq!(
            field(NetworkSpec {
                publish: vec![fwd("::1", 2222)],
                ..Default::default()
            }),
            "spec.network.publish[0].host_address"
        );
        // Same port, other protocol or other address: both fine.
        let mut udp = fwd("127.0.0.1", 2222);
        udp.protocol = Protocol::Udp;
        NetworkSpec {
            publish: vec![fwd("127.0.0.1", 2222), udp, fwd("127.0.0.2", 2222)],
            ..Default::default()
        }
        .validate()
        .unwrap();
    }
}
