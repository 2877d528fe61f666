//! Credentials for the migration stream: QEMU's `tls-creds-x509`, with a
//! cluster CA and one certificate per node, made by Keel (`keel cluster
//! init-ca`, `keel cluster issue-cert NODE`).
//!
//! A node's credentials are one directory (`<data dir>/migration-tls`, the
//! driver's `QemuConfig::migration_tls`) in the layout QEMU 7.2 reads for
//! both endpoints (`crypto/tlscredsx509.c`): `ca-cert.pem`, and the node's
//! certificate and key twice, as `server-*` (the node as a target) and
//! `client-*` (as a source). QEMU is handed only the directory's path over
//! QMP, never a key or a file's content, and nothing of it appears on a
//! command line. Keys are written mode 0600 and refused when readable by
//! anyone else.
//!
//! Both ends verify the peer (`verify-peer=on`): the target accepts only a
//! source whose certificate the cluster CA signed, and the source checks
//! that the target's certificate names the target node (`tls-hostname`).
//! Node certificates carry both TLS purposes, since every node is source
//! and target in turn, and the node name as their DNS name.
//!
//! Generated with `rcgen` (ECDSA P-256, signed in-process): the well-kept
//! crate rustls' own tests use, rather than shelling out to certtool or
//! openssl.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// Under a node's data dir: that node's migration credentials.
pub const CREDS_DIR: &str = "migration-tls";
pub const CA_CERT: &str = "ca-cert.pem";
/// Only in the CA's own directory, never on a node.
pub const CA_KEY: &str = "ca-key.pem";
pub const SERVER_CERT: &str = "server-cert.pem";
pub const SERVER_KEY: &str = "server-key.pem";
pub const CLIENT_CERT: &str = "client-cert.pem";
pub const CLIENT_KEY: &str = "client-key.pem";

/// The CA's subject. Fixed, so that the issuer of a node certificate can be
/// rebuilt from the CA key alone; a certificate from another CA (same
/// subject, other key) fails the signature check.
const CA_COMMON_NAME: &str = "Keel migration CA";
const CA_VALID_DAYS: i64 = 10 * 365;
const NODE_VALID_DAYS: i64 = 2 * 365;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: already exists; remove it to start over (every node certificate it issued stops working)", path.display())]
    Exists { path: PathBuf },
    #[error("generating the {what}")]
    Generate {
        what: &'static str,
        #[source]
        source: rcgen::Error,
    },
    #[error("{}: {reason}", path.display())]
    Invalid { path: PathBuf, reason: String },
    #[error(transparent)]
    NotOwned(#[from] crate::ownership::OwnershipError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `content` to `dir/name` (mode 0600 for keys, 0644 otherwise),
/// through a temporary file, so a reader never sees half a file.
fn write_file(dir: &Path, name: &str, content: &str, secret: bool) -> Result<(), TlsError> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let mode = if secret { 0o600 } else { 0o644 };
    // A leftover (or planted) file or symlink at the temporary name is
    // removed, not followed: the key is written only into a file this call
    // created (O_EXCL).
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(content.as_bytes())?;
            f.sync_all()
        })
        .and_then(|()| std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(io_err(&path))
}

fn private_dir(dir: &Path) -> Result<(), TlsError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err(dir))?;
    owned(dir)
}

/// Refuses a credentials directory another user owns ([`crate::ownership`]).
fn owned(dir: &Path) -> Result<(), TlsError> {
    Ok(crate::ownership::ensure_owned("TLS directory", dir)?)
}

fn ca_params() -> Result<CertificateParams, TlsError> {
    let mut params =
        CertificateParams::new(Vec::<String>::new()).map_err(|source| TlsError::Generate {
            what: "CA certificate",
            source,
        })?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

fn validity(params: &mut CertificateParams, days: i64) {
    let now = time::OffsetDateTime::now_utc();
    // An hour back: a peer whose clock is a little behind still accepts it.
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(days);
}

/// Creates the cluster CA in `ca_dir` (`ca-cert.pem`, `ca-key.pem` 0600).
/// Refuses to replace an existing one.
pub fn init_ca(ca_dir: &Path) -> Result<(), TlsError> {
    let key_path = ca_dir.join(CA_KEY);
    if key_path.exists() {
        return Err(TlsError::Exists { path: key_path });
    }
    private_dir(ca_dir)?;
    let key = KeyPair::generate().map_err(|source| TlsError::Generate {
        what: "CA key",
        source,
    })?;
    let mut params = ca_params()?;
    validity(&mut params, CA_VALID_DAYS);
    let cert = params
        .self_signed(&key)
        .map_err(|source| TlsError::Generate {
            what: "CA certificate",
            source,
        })?;
    // The key first: a directory with a certificate but no key is a CA
    // that cannot issue.
    write_file(ca_dir, CA_KEY, &key.serialize_pem(), true)?;
    write_file(ca_dir, CA_CERT, &cert.pem(), false)
}

/// Issues `node`'s certificate from the CA in `ca_dir` and writes the
/// node's credentials directory `out_dir` (see the module doc). Replaces a
/// previous certificate of the node: QEMU reads the files anew for every
/// migration.
pub fn issue(ca_dir: &Path, node: &str, out_dir: &Path) -> Result<(), TlsError> {
    keel_api::validate_name("node", node).map_err(|e| TlsError::Invalid {
        path: out_dir.to_path_buf(),
        reason: e.to_string(),
    })?;
    owned(ca_dir)?;
    let ca_key_path = ca_dir.join(CA_KEY);
    let ca_cert_path = ca_dir.join(CA_CERT);
    let ca_key_pem = std::fs::read_to_string(&ca_key_path).map_err(io_err(&ca_key_path))?;
    let ca_cert_pem = std::fs::read_to_string(&ca_cert_path).map_err(io_err(&ca_cert_path))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(|e| TlsError::Invalid {
        path: ca_key_path.clone(),
        reason: format!("not a private key: {e}"),
    })?;
    // The issuer as rcgen needs it: same subject and key as the CA's
    // certificate, which is what a child's issuer name and authority key
    // id are made of.
    let issuer = ca_params()?
        .self_signed(&ca_key)
        .map_err(|source| TlsError::Generate {
            what: "CA issuer",
            source,
        })?;

    let key = KeyPair::generate().map_err(|source| TlsError::Generate {
        what: "node key",
        source,
    })?;
    let mut params =
        CertificateParams::new(vec![node.to_string()]).map_err(|source| TlsError::Generate {
            what: "node certificate",
            source,
        })?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, node);
    params.distinguished_name = dn;
    params.subject_alt_names = vec![SanType::DnsName(node.try_into().map_err(|e| {
        TlsError::Invalid {
            path: out_dir.to_path_buf(),
            reason: format!("node name {node:?} is not a DNS name: {e}"),
        }
    })?)];
    params.is_ca = IsCa::ExplicitNoCa;
    // What QEMU checks of a non-CA certificate (crypto/tlscredsx509.c).
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, NODE_VALID_DAYS);
    let cert = params
        .signed_by(&key, &issuer, &ca_key)
        .map_err(|source| TlsError::Generate {
            what: "node certificate",
            source,
        })?;

    private_dir(out_dir)?;
    let (cert_pem, key_pem) = (cert.pem(), key.serialize_pem());
    write_file(out_dir, SERVER_KEY, &key_pem, true)?;
    write_file(out_dir, CLIENT_KEY, &key_pem, true)?;
    write_file(out_dir, SERVER_CERT, &cert_pem, false)?;
    write_file(out_dir, CLIENT_CERT, &cert_pem, false)?;
    // The CA's certificate as the CA dir has it (not the rebuilt issuer):
    // it is what every other node trusts.
    write_file(out_dir, CA_CERT, &ca_cert_pem, false)
}

/// Whether `dir` holds a node's credentials QEMU can use: every file
/// present, parseable as PEM of the right kind, and the keys private to
/// this user (mode 0600 or stricter). Why not, otherwise.
pub fn check_creds(dir: &Path) -> Result<(), TlsError> {
    owned(dir)?;
    for (name, secret) in [
        (CA_CERT, false),
        (SERVER_CERT, false),
        (SERVER_KEY, true),
        (CLIENT_CERT, false),
        (CLIENT_KEY, true),
    ] {
        let path = dir.join(name);
        let meta = std::fs::metadata(&path).map_err(io_err(&path))?;
        if secret && meta.permissions().mode() & 0o077 != 0 {
            return Err(TlsError::Invalid {
                path,
                reason: format!(
                    "mode {:o}: a private key must be readable by its owner only (0600)",
                    meta.permissions().mode() & 0o777
                ),
            });
        }
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        let marker = if secret {
            "-----BEGIN PRIVATE KEY-----"
        } else {
            "-----BEGIN CERTIFICATE-----"
        };
        if !text.contains(marker) {
            return Err(TlsError::Invalid {
                path,
                reason: format!("expected PEM with {marker}"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_gets_private_keys_and_the_cas_certificate() {
        let tmp = tempfile::tempdir().unwrap();
        let ca = tmp.path().join("ca");
        let node = tmp.path().join("node-a");
        init_ca(&ca).unwrap();
        assert!(matches!(init_ca(&ca), Err(TlsError::Exists { .. })));
        let mode = |p: PathBuf| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(ca.join(CA_KEY)), 0o600);

        issue(&ca, "node-a", &node).unwrap();
        check_creds(&node).unwrap();
        assert_eq!(mode(node.join(SERVER_KEY)), 0o600);
        assert_eq!(mode(node.join(CLIENT_KEY)), 0o600);
        assert!(!node.join(CA_KEY).exists(), "the CA key stays with the CA");
        assert_eq!(
            std::fs::read_to_string(node.join(CA_CERT)).unwrap(),
            std::fs::read_to_string(ca.join(CA_CERT)).unwrap()
        );

        std::fs::set_permissions(
            node.join(CLIENT_KEY),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let err = check_creds(&node).unwrap_err().to_string();
        assert!(err.contains("0600"), "{err}");
        assert!(issue(&ca, "Not A Name", &node).is_err());
    }
}
