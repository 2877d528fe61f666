//! How Keel may reach its etcd store: `--store etcds://…` with
//! `--etcd-ca`, `--etcd-cert` and `--etcd-key` (the server verified against
//! that CA only, the client certificate presented to an etcd run with
//! `--client-cert-auth`), or plain `etcd://…` only when asked for with
//! `--insecure-store`, since whoever reaches a plain etcd rewrites any VM,
//! node record or the leader key. The plain store is warned about at every
//! start (`StoreSpec::connect_etcd`).
//!
//! The flags are one struct flattened into every command that takes a
//! `--store` (`keel serve`, `keel agent`, `keel doctor`), and
//! [`StoreAccessArgs::resolve`] is the one place the rule is applied.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use keel_store::etcd::EtcdTls;

use crate::distributed::StoreSpec;

#[derive(Debug, Clone, Default, Args)]
pub struct StoreAccessArgs {
    /// With --store etcds://: the CA (PEM) etcd's server certificate must
    /// chain to (`keel cluster init-ca`'s ca-cert.pem).
    #[arg(long, env = "KEEL_ETCD_CA", value_name = "PEM")]
    pub etcd_ca: Option<PathBuf>,
    /// With --store etcds://: this client's certificate (PEM), which etcd
    /// checks with --client-cert-auth (`keel cluster issue-cert NAME
    /// --etcd-client`).
    #[arg(long, env = "KEEL_ETCD_CERT", value_name = "PEM")]
    pub etcd_cert: Option<PathBuf>,
    /// The private key of --etcd-cert (PEM).
    #[arg(long, env = "KEEL_ETCD_KEY", value_name = "PEM")]
    pub etcd_key: Option<PathBuf>,
    /// Allow --store etcd:// (plain gRPC, no TLS, no authentication:
    /// anyone who reaches etcd can rewrite the cluster's state). For a
    /// test etcd on loopback; warned about at every start.
    #[arg(long, env = "KEEL_INSECURE_STORE")]
    pub insecure_store: bool,
}

impl StoreAccessArgs {
    /// `spec` with its TLS material read from the flags, or why the flags
    /// do not fit it (naming the flag).
    pub fn resolve(&self, spec: StoreSpec) -> anyhow::Result<StoreSpec> {
        let given = [
            ("--etcd-ca", &self.etcd_ca),
            ("--etcd-cert", &self.etcd_cert),
            ("--etcd-key", &self.etcd_key),
        ];
        match spec {
            StoreSpec::Sqlite => {
                if let Some((flag, _)) = given.iter().find(|(_, v)| v.is_some()) {
                    bail!("{flag} is for an etcds:// --store, not sqlite");
                }
                if self.insecure_store {
                    bail!("--insecure-store is for an etcd:// --store, not sqlite");
                }
                Ok(StoreSpec::Sqlite)
            }
            ref etcd @ StoreSpec::Etcd { .. } if !etcd.is_tls() => {
                if !self.insecure_store {
                    bail!(
                        "--store {etcd}: plain etcd:// has no TLS and no authentication \
                         (anyone who reaches etcd can rewrite every VM, node and the leader \
                         key); use etcds:// with --etcd-ca, --etcd-cert and --etcd-key, or \
                         pass --insecure-store to accept that"
                    );
                }
                if let Some((flag, _)) = given.iter().find(|(_, v)| v.is_some()) {
                    bail!("{flag} needs an etcds:// --store, got {etcd}");
                }
                Ok(spec)
            }
            StoreSpec::Etcd {
                endpoints,
                namespace,
                ..
            } => {
                if self.insecure_store {
                    bail!("--insecure-store is for an etcd:// --store; this one is etcds://");
                }
                let ca_pem = read_pem("--etcd-ca", self.etcd_ca.as_deref(), "CERTIFICATE")?;
                let cert = read_pem("--etcd-cert", self.etcd_cert.as_deref(), "CERTIFICATE")?;
                let key = read_pem("--etcd-key", self.etcd_key.as_deref(), "PRIVATE KEY")?;
                Ok(StoreSpec::Etcd {
                    endpoints,
                    namespace,
                    tls: Some(EtcdTls {
                        ca_pem,
                        identity: Some((cert, key)),
                    }),
                })
            }
        }
    }

    /// The flags that give `spec`, for a child process (tests, the bench).
    pub fn to_flags(&self) -> Vec<String> {
        let mut flags = Vec::new();
        for (flag, path) in [
            ("--etcd-ca", &self.etcd_ca),
            ("--etcd-cert", &self.etcd_cert),
            ("--etcd-key", &self.etcd_key),
        ] {
            if let Some(path) = path {
                flags.push(flag.to_string());
                flags.push(path.display().to_string());
            }
        }
        if self.insecure_store {
            flags.push("--insecure-store".to_string());
        }
        flags
    }
}

/// The file's bytes if it holds a PEM block of `label` (`PRIVATE KEY`
/// matches any kind of private key): a wrong file is an error naming the
/// flag now, not a handshake failure later.
fn read_pem(flag: &str, path: Option<&Path>, label: &str) -> anyhow::Result<Vec<u8>> {
    let Some(path) = path else {
        bail!("{flag} is required with an etcds:// --store");
    };
    let bytes = std::fs::read(path).with_context(|| format!("{flag} {}", path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    let found = text.lines().any(|line| {
        line.strip_prefix("-----BEGIN ")
            .and_then(|rest| rest.strip_suffix("-----"))
            .is_some_and(|kind| kind.ends_with(label))
    });
    if !found {
        bail!("{flag} {}: no PEM {label} in it", path.display());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pem(dir: &Path, name: &str, label: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(
            &path,
            format!("-----BEGIN {label}-----\nAA==\n-----END {label}-----\n"),
        )
        .unwrap();
        path
    }

    fn err(args: &StoreAccessArgs, store: &str) -> String {
        format!("{:#}", args.resolve(store.parse().unwrap()).unwrap_err())
    }

    #[test]
    fn plain_etcd_needs_insecure_store() {
        let none = StoreAccessArgs::default();
        let e = err(&none, "etcd://127.0.0.1:2379");
        assert!(e.contains("--insecure-store"), "{e}");
        let insecure = StoreAccessArgs {
            insecure_store: true,
            ..Default::default()
        };
        let spec = insecure
            .resolve("etcd://127.0.0.1:2379".parse().unwrap())
            .unwrap();
        assert!(!spec.is_tls());
        assert!(none.resolve(StoreSpec::Sqlite).is_ok());
        assert!(err(&insecure, "sqlite").contains("--insecure-store"));
        assert!(err(&insecure, "etcds://127.0.0.1:2379").contains("--insecure-store"));
    }

    #[test]
    fn etcds_reads_every_file_and_names_the_missing_flag() {
        let dir = tempfile::tempdir().unwrap();
        let full = StoreAccessArgs {
            etcd_ca: Some(pem(dir.path(), "ca.pem", "CERTIFICATE")),
            etcd_cert: Some(pem(dir.path(), "cert.pem", "CERTIFICATE")),
            etcd_key: Some(pem(dir.path(), "key.pem", "PRIVATE KEY")),
            insecure_store: false,
        };
        let spec = full
            .resolve("etcds://127.0.0.1:2379".parse().unwrap())
            .unwrap();
        let StoreSpec::Etcd { tls: Some(tls), .. } = &spec else {
            panic!("no TLS material: {spec:?}");
        };
        assert!(tls.identity.is_some());

        for flag in ["--etcd-ca", "--etcd-cert", "--etcd-key"] {
            let with = |value: Option<PathBuf>| {
                let mut args = full.clone();
                match flag {
                    "--etcd-ca" => args.etcd_ca = value,
                    "--etcd-cert" => args.etcd_cert = value,
                    _ => args.etcd_key = value,
                }
                args
            };
            let missing = with(None);
            let unreadable = with(Some(dir.path().join("absent.pem")));
            let wrong = with(Some(pem(dir.path(), "other.pem", "SOMETHING ELSE")));
            for args in [missing, unreadable, wrong] {
                let e = err(&args, "etcds://127.0.0.1:2379");
                assert!(e.contains(flag), "{flag}: {e}");
            }
        }
        let e = err(&full, "etcd://127.0.0.1:2379");
        assert!(e.contains("--insecure-store"), "{e}");
    }
}
