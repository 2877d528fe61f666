//! How a node's live migrations travel: `keel cluster init-ca` /
//! `issue-cert` (the credentials, made by `keel_hv::qemu::tls`), and the
//! agent's choice of transport from its flags and its data dir.
//!
//! The rule: TCP with TLS whenever the node has credentials; plain TCP only
//! with an explicit `--insecure-migration` (the driver logs it loudly at
//! every start); otherwise a Unix socket, which reaches only sources on the
//! same host, with a warning that cross-host migrations will fail.

use std::net::{IpAddr, UdpSocket};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use keel_hv::qemu::tls;

use crate::args::{ClusterCommand, ClusterVerb, MigrationListen, DEFAULT_MIGRATION_PORTS};
use crate::distributed::StoreSpec;

pub fn cluster(cmd: ClusterCommand) -> anyhow::Result<()> {
    match cmd.verb {
        ClusterVerb::InitCa { ca_dir } => {
            tls::init_ca(&ca_dir).with_context(|| format!("--ca-dir {}", ca_dir.display()))?;
            println!(
                "created the migration CA in {} (keep {} private: it can admit any node)",
                ca_dir.display(),
                ca_dir.join(tls::CA_KEY).display()
            );
            Ok(())
        }
        ClusterVerb::IssueCert {
            node,
            ca_dir,
            valid_days,
            etcd_server,
            etcd_client,
            api_server,
            ip,
            dns,
            out,
            ..
        } if etcd_server || etcd_client || api_server => {
            use tls::service::ServiceRole;
            let (role, what) = if etcd_server {
                (ServiceRole::EtcdServer, "etcd server")
            } else if etcd_client {
                (ServiceRole::EtcdClient, "etcd client")
            } else {
                (ServiceRole::ApiServer, "API server")
            };
            tls::service::issue_service(&ca_dir, &node, role, &ip, &dns, &out, valid_days)
                .with_context(|| {
                    format!(
                        "issuing {node}'s {what} certificate from --ca-dir {}",
                        ca_dir.display()
                    )
                })?;
            let (cert, key) = (
                out.join(tls::service::cert_file(&node)),
                out.join(tls::service::key_file(&node)),
            );
            let ca = out.join(tls::CA_CERT);
            let next = match role {
                ServiceRole::EtcdServer => format!(
                    "run etcd with --client-cert-auth --trusted-ca-file {} --cert-file {} \
                     --key-file {}",
                    ca.display(),
                    cert.display(),
                    key.display()
                ),
                ServiceRole::EtcdClient => format!(
                    "pass keel serve/agent --etcd-ca {} --etcd-cert {} --etcd-key {}",
                    ca.display(),
                    cert.display(),
                    key.display()
                ),
                ServiceRole::ApiServer => format!(
                    "pass every control plane --tls-cert {} --tls-key {}, and clients \
                     --ca-file {}",
                    cert.display(),
                    key.display(),
                    ca.display()
                ),
            };
            println!(
                "issued {what} certificate {node} into {}; {next}",
                out.display()
            );
            Ok(())
        }
        ClusterVerb::IssueCert {
            node,
            ca_dir,
            data_dir,
            valid_days,
            control_plane,
            ..
        } => {
            let out = creds_dir(&data_dir);
            let (issue, what): (fn(&Path, &str, &Path, u32) -> _, _) = if control_plane {
                (tls::issue_control_plane, "control plane")
            } else {
                (tls::issue_valid_for, "node")
            };
            issue(&ca_dir, &node, &out, valid_days).with_context(|| {
                format!(
                    "issuing {what} {node}'s certificate from --ca-dir {}",
                    ca_dir.display()
                )
            })?;
            println!(
                "issued {what} {node}'s cluster certificate into {} (valid {valid_days} days; \
                 renew it by issuing it again)",
                out.display()
            );
            Ok(())
        }
        ClusterVerb::RevokeCert {
            node,
            ca_dir,
            data_dir,
        } => {
            let done = tls::revoke(&ca_dir, &node, &data_dir).with_context(|| {
                format!(
                    "revoking node {node}'s certificates in --ca-dir {}",
                    ca_dir.display()
                )
            })?;
            println!(
                "revoked {} certificate(s) of node {node} ({}); the CRL is {}",
                done.serials.len(),
                done.serials.join(", "),
                ca_dir.join(tls::CA_CRL).display()
            );
            for dir in &done.distributed {
                println!("copied the CRL into {}", dir.display());
            }
            println!(
                "copy it into DATA_DIR/{}/{} of every other node",
                tls::CREDS_DIR,
                tls::CA_CRL
            );
            Ok(())
        }
    }
}

/// A node's migration credentials, in its data dir.
pub fn creds_dir(data_dir: &Path) -> PathBuf {
    data_dir.join(tls::CREDS_DIR)
}

/// What the node's driver is told: where to listen (None: a Unix socket)
/// and with which credentials (None: plain).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrationSettings {
    pub listen: Option<MigrationListen>,
    pub tls: Option<PathBuf>,
}

/// The transport rule of this module, for an agent with `data_dir`, the
/// store it talks to, and its flags.
pub fn settings(
    data_dir: &Path,
    store: &StoreSpec,
    listen: Option<&MigrationListen>,
    insecure: bool,
) -> anyhow::Result<MigrationSettings> {
    let dir = creds_dir(data_dir);
    let tls = if dir.exists() {
        tls::check_creds(&dir).context("the node's migration credentials")?;
        Some(dir.clone())
    } else {
        None
    };
    if tls.is_none() && !insecure {
        if listen.is_some() {
            bail!(
                "--migration-listen: this node has no migration credentials ({} is missing); \
                 issue them with `keel cluster issue-cert NODE --data-dir {}`, or pass \
                 --insecure-migration to send guests' memory unencrypted",
                dir.display(),
                data_dir.display()
            );
        }
        tracing::warn!(
            creds = %dir.display(),
            "no migration credentials: incoming migrations listen on a Unix socket, so \
             migrations from other hosts fail (keel cluster issue-cert, or --insecure-migration)"
        );
        return Ok(MigrationSettings::default());
    }
    let listen = match listen {
        Some(l) => l.clone(),
        None => MigrationListen {
            address: host_address(store)?,
            ports: DEFAULT_MIGRATION_PORTS,
        },
    };
    Ok(MigrationSettings {
        listen: Some(listen),
        tls,
    })
}

/// This host's address as the store sees it: the source address the
/// kernel picks for the route to the first store endpoint (a UDP socket
/// connected, nothing sent).
fn host_address(store: &StoreSpec) -> anyhow::Result<IpAddr> {
    let StoreSpec::Etcd { endpoints, .. } = store else {
        bail!("--migration-listen is needed without an etcd store");
    };
    let endpoint = endpoints.first().context("the store names no endpoint")?;
    let host_port = endpoint
        .trim_start_matches("http://")
        .trim_start_matches("https://");
    let socket = UdpSocket::bind(("0.0.0.0", 0))
        .or_else(|_| UdpSocket::bind(("::", 0)))
        .context("finding this host's address")?;
    socket
        .connect(host_port)
        .with_context(|| format!("finding this host's address towards {host_port}"))?;
    let ip = socket
        .local_addr()
        .context("finding this host's address")?
        .ip();
    if ip.is_unspecified() {
        bail!("no address towards {host_port}: pass --migration-listen ADDR:FIRST-LAST");
    }
    Ok(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_when_credentials_exist_plain_only_when_asked() {
        let tmp = tempfile::tempdir().unwrap();
        let store: StoreSpec = "etcd://127.0.0.1:2379".parse().unwrap();
        let given = crate::args::parse_migration_listen("127.0.0.1:47000-47009").unwrap();

        // Nothing: a Unix socket. A listen address without credentials or
        // --insecure-migration is refused.
        assert_eq!(
            settings(tmp.path(), &store, None, false).unwrap(),
            MigrationSettings::default()
        );
        let err = settings(tmp.path(), &store, Some(&given), false).unwrap_err();
        assert!(err.to_string().contains("--insecure-migration"), "{err}");
        // Insecure, asked for: plain TCP, on the host's address by default.
        let plain = settings(tmp.path(), &store, None, true).unwrap();
        assert_eq!(plain.tls, None);
        let listen = plain.listen.unwrap();
        assert_eq!(listen.address, "127.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(listen.ports, DEFAULT_MIGRATION_PORTS);

        // With credentials: TLS, whatever the flag.
        let ca = tmp.path().join("ca");
        tls::init_ca(&ca).unwrap();
        tls::issue(&ca, "a", &creds_dir(tmp.path())).unwrap();
        for insecure in [false, true] {
            let s = settings(tmp.path(), &store, Some(&given), insecure).unwrap();
            assert_eq!(s.tls, Some(creds_dir(tmp.path())));
            assert_eq!(s.listen, Some(given.clone()));
        }
        assert!(crate::args::parse_migration_listen("0.0.0.0:1-2").is_err());
        assert!(crate::args::parse_migration_listen("127.0.0.1:9-2").is_err());
        assert!(crate::args::parse_migration_listen("127.0.0.1").is_err());
        assert_eq!(
            crate::args::parse_migration_listen("[::1]:7")
                .unwrap()
                .ports,
            7..=7
        );
    }
}
