//! `keel vm create` flags for the NIC and cloud-init, and their lines in
//! `keel vm get`.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use keel_api::cloud_init::MAX_USER_DATA_BYTES;
use keel_api::{CloudInitSpec, NetworkMode, NetworkSpec, PortForward, VirtualMachine};

#[derive(Debug, Clone, Default, Args)]
pub struct NetArgs {
    /// `user` (QEMU user-mode networking, the default) or `bridge=NAME`
    /// (a tap on Linux bridge NAME on the node).
    #[arg(long, value_parser = parse_network, value_name = "user|bridge=NAME")]
    pub network: Option<(NetworkMode, Option<String>)>,
    /// Forward a host port into the guest (user mode): [ADDR:]HOSTPORT:GUESTPORT[/tcp|/udp],
    /// ADDR 127.0.0.1 unless given. Repeat for more.
    #[arg(long = "publish", short = 'p', value_parser = parse_publish, value_name = "[ADDR:]HOSTPORT:GUESTPORT[/PROTO]")]
    pub publish: Vec<PortForward>,
    /// The NIC's MAC (unicast, six octets); Keel assigns one if not given.
    #[arg(long)]
    pub mac: Option<String>,
    /// A public key file (authorized_keys format, one key or several) for
    /// the image's default user, via cloud-init. Repeat for more.
    #[arg(long = "ssh-key", value_name = "FILE")]
    pub ssh_keys: Vec<PathBuf>,
    /// cloud-init user-data file (at most 64 KiB). With --ssh-key too, both
    /// are sent as one multipart: the keys are appended to the file's own.
    #[arg(long = "user-data", value_name = "FILE")]
    pub user_data: Option<PathBuf>,
}

fn parse_network(s: &str) -> Result<(NetworkMode, Option<String>), String> {
    match s.split_once('=') {
        None if s == "user" => Ok((NetworkMode::User, None)),
        Some(("bridge", name)) => {
            keel_api::network::validate_ifname("--network bridge", name).map_err(|e| e.message)?;
            Ok((NetworkMode::Bridge, Some(name.to_string())))
        }
        _ => Err(format!("{s:?}: expected `user` or `bridge=NAME`")),
    }
}

fn parse_publish(s: &str) -> Result<PortForward, String> {
    s.parse()
}

impl NetArgs {
    /// The NIC the flags ask for. Values are checked again by the server,
    /// whose errors name the field.
    pub fn network(&self) -> NetworkSpec {
        let (mode, bridge) = self.network.clone().unwrap_or((NetworkMode::User, None));
        NetworkSpec {
            mac: self.mac.clone(),
            mode,
            bridge,
            publish: self.publish.clone(),
        }
    }

    /// The cloud-init settings from the files named, `None` without any.
    pub fn cloud_init(&self) -> anyhow::Result<Option<CloudInitSpec>> {
        if self.ssh_keys.is_empty() && self.user_data.is_none() {
            return Ok(None);
        }
        let mut keys = Vec::new();
        for path in &self.ssh_keys {
            let text = read_limited(path, 256 * 1024, "--ssh-key")?;
            let before = keys.len();
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from),
            );
            if keys.len() == before {
                bail!("--ssh-key {}: no key in the file", path.display());
            }
        }
        let user_data = match &self.user_data {
            Some(path) => Some(read_limited(path, MAX_USER_DATA_BYTES, "--user-data")?),
            None => None,
        };
        Ok(Some(CloudInitSpec {
            ssh_authorized_keys: keys,
            user_data,
            instance_id: None,
        }))
    }
}

fn read_limited(path: &Path, limit: usize, flag: &str) -> anyhow::Result<String> {
    let file = std::fs::File::open(path).with_context(|| format!("{flag} {}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(limit as u64 + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("{flag} {}", path.display()))?;
    if bytes.len() > limit {
        bail!(
            "{flag} {}: larger than {} KiB",
            path.display(),
            limit / 1024
        );
    }
    String::from_utf8(bytes).with_context(|| format!("{flag} {}: not UTF-8 text", path.display()))
}

/// The `keel vm get` lines: MAC, mode and forwards, cloud-init.
pub fn describe(vm: &VirtualMachine) -> Vec<(&'static str, String)> {
    let n = &vm.spec.network;
    let mut pairs = vec![
        ("mac", vm.mac().to_string()),
        (
            "network",
            match (&n.mode, &n.bridge) {
                (NetworkMode::Bridge, Some(b)) => format!("bridge {b}"),
                (mode, _) => mode.to_string(),
            },
        ),
    ];
    if !n.publish.is_empty() {
        let list: Vec<String> = n
            .publish
            .iter()
            .map(|f| {
                format!(
                    "{}:{} -> {}/{}",
                    f.host_address, f.host_port, f.guest_port, f.protocol
                )
            })
            .collect();
        pairs.push(("publish", list.join(", ")));
    }
    if let Some(ci) = &vm.spec.cloud_init {
        let mut parts = Vec::new();
        if !ci.ssh_authorized_keys.is_empty() {
            parts.push(format!("{} ssh key(s)", ci.ssh_authorized_keys.len()));
        }
        if let Some(u) = &ci.user_data {
            parts.push(format!("user-data {} bytes", u.len()));
        }
        if let Some(id) = &ci.instance_id {
            parts.push(format!("instance-id {id}"));
        }
        pairs.push(("cloud-init", parts.join(", ")));
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_flag_forms() {
        assert_eq!(parse_network("user").unwrap(), (NetworkMode::User, None));
        assert_eq!(
            parse_network("bridge=br0").unwrap(),
            (NetworkMode::Bridge, Some("br0".into()))
        );
        for bad in [
            "bridge",
            "bridge=",
            "tap=x",
            "bridge=a/b",
            "bridge=waytoolongbridgename",
        ] {
            assert!(parse_network(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn key_files_may_hold_several_keys_and_comments() {
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys.pub");
        std::fs::write(&keys, "# mine\nssh-ed25519 AAAA a\n\nssh-rsa BBBB b\n").unwrap();
        let empty = dir.path().join("empty.pub");
        std::fs::write(&empty, "# nothing\n").unwrap();
        let args = NetArgs {
            ssh_keys: vec![keys.clone()],
            ..Default::default()
        };
        let ci = args.cloud_init().unwrap().unwrap();
        assert_eq!(
            ci.ssh_authorized_keys,
            ["ssh-ed25519 AAAA a", "ssh-rsa BBBB b"]
        );
        let args = NetArgs {
            ssh_keys: vec![empty],
            ..Default::default()
        };
        assert!(args
            .cloud_init()
            .unwrap_err()
            .to_string()
            .contains("--ssh-key"));
        let big = dir.path().join("big");
        std::fs::write(&big, "x".repeat(MAX_USER_DATA_BYTES + 1)).unwrap();
        let args = NetArgs {
            user_data: Some(big),
            ..Default::default()
        };
        assert!(args
            .cloud_init()
            .unwrap_err()
            .to_string()
            .contains("--user-data"));
        assert!(NetArgs::default().cloud_init().unwrap().is_none());
    }
}
