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
//! source whose certificate the cluster CA signed, did not revoke
//! ([`revocation`], `ca-crl.pem`) and names the source node of the
//! migration (`tls-authz`, matched on the subject `CN=<node>`), and the
//! source checks that the target's certificate names the target node
//! (`tls-hostname`, matched on the DNS name). Node certificates carry both
//! TLS purposes, since every node is source and target in turn, the node
//! name as their only subject attribute and as their DNS name, and live
//! 90 days unless asked otherwise: renewed by issuing anew.
//!
//! Generated with `rcgen` (ECDSA P-256, signed in-process): the well-kept
//! crate rustls' own tests use, rather than shelling out to certtool or
//! openssl.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};

pub mod revocation;
pub mod service;

pub use revocation::{revoke, CA_CRL};

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
/// A node certificate's life unless asked otherwise: short, so that a
/// stolen key is not good for long even where nobody revokes it.
pub const DEFAULT_NODE_VALID_DAYS: u32 = 90;
/// The longest a node certificate may be asked to live (the CA's life).
pub const MAX_NODE_VALID_DAYS: u32 = 10 * 365;

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

fn read_ca_key(ca_dir: &Path) -> Result<KeyPair, TlsError> {
    let path = ca_dir.join(CA_KEY);
    let pem = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    KeyPair::from_pem(&pem).map_err(|e| TlsError::Invalid {
        path,
        reason: format!("not a private key: {e}"),
    })
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
    write_file(ca_dir, CA_CERT, &cert.pem(), false)?;
    // An empty CRL from the start, so every node's credentials carry one
    // and a later revocation only replaces a file.
    revocation::write_crl(ca_dir, &key)
}

/// [`issue_valid_for`] the default life, [`DEFAULT_NODE_VALID_DAYS`].
pub fn issue(ca_dir: &Path, node: &str, out_dir: &Path) -> Result<(), TlsError> {
    issue_valid_for(ca_dir, node, out_dir, DEFAULT_NODE_VALID_DAYS)
}

/// Issues `node`'s certificate, valid for `days`, from the CA in `ca_dir`
/// and writes the node's credentials directory `out_dir` (see the module
/// doc) with the CA's current CRL. Replaces a previous certificate of the
/// node, which is how a certificate is renewed: QEMU reads the files anew
/// for every migration. The CA records it ([`revocation::ISSUED`]).
pub fn issue_valid_for(
    ca_dir: &Path,
    node: &str,
    out_dir: &Path,
    days: u32,
) -> Result<(), TlsError> {
    issue_as(ca_dir, node, &[], out_dir, days)
}

/// Issues a control plane's certificate: a node certificate of the name
/// `name` that also carries [`CONTROL_PLANE_DNS_NAME`], which agents
/// require of whoever asks them for a console. A node's own certificate
/// never carries it, so a node cannot pass for a control plane.
pub fn issue_control_plane(
    ca_dir: &Path,
    name: &str,
    out_dir: &Path,
    days: u32,
) -> Result<(), TlsError> {
    issue_as(ca_dir, name, &[CONTROL_PLANE_DNS_NAME], out_dir, days)
}

/// The DNS name of every control plane's certificate. It has a dot, so no
/// node (whose names are DNS labels) can be issued it by accident.
pub const CONTROL_PLANE_DNS_NAME: &str = "control-plane.keel";

fn issue_as(
    ca_dir: &Path,
    node: &str,
    extra_names: &[&str],
    out_dir: &Path,
    days: u32,
) -> Result<(), TlsError> {
    keel_api::validate_name("node", node).map_err(|e| TlsError::Invalid {
        path: out_dir.to_path_buf(),
        reason: e.to_string(),
    })?;
    if !(1..=MAX_NODE_VALID_DAYS).contains(&days) {
        return Err(TlsError::Invalid {
            path: out_dir.to_path_buf(),
            reason: format!("valid days {days}: expected 1-{MAX_NODE_VALID_DAYS}"),
        });
    }
    owned(ca_dir)?;
    let ca_cert_path = ca_dir.join(CA_CERT);
    let ca_cert_pem = std::fs::read_to_string(&ca_cert_path).map_err(io_err(&ca_cert_path))?;
    let ca_key = read_ca_key(ca_dir)?;
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
    params.subject_alt_names = std::iter::once(node)
        .chain(extra_names.iter().copied())
        .map(|name| {
            name.try_into()
                .map(SanType::DnsName)
                .map_err(|e| TlsError::Invalid {
                    path: out_dir.to_path_buf(),
                    reason: format!("node name {name:?} is not a DNS name: {e}"),
                })
        })
        .collect::<Result<_, _>>()?;
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
    // Random, and recorded: what a CRL names to revoke this certificate.
    let serial = revocation::new_serial();
    params.serial_number = Some(SerialNumber::from(serial.clone()));
    validity(&mut params, i64::from(days));
    let not_after = params.not_after;
    let cert = params
        .signed_by(&key, &issuer, &ca_key)
        .map_err(|source| TlsError::Generate {
            what: "node certificate",
            source,
        })?;

    private_dir(out_dir)?;
    revocation::record_issued(ca_dir, node, &serial, not_after)?;
    let (cert_pem, key_pem) = (cert.pem(), key.serialize_pem());
    write_file(out_dir, SERVER_KEY, &key_pem, true)?;
    write_file(out_dir, CLIENT_KEY, &key_pem, true)?;
    write_file(out_dir, SERVER_CERT, &cert_pem, false)?;
    write_file(out_dir, CLIENT_CERT, &cert_pem, false)?;
    // The CA's certificate as the CA dir has it (not the rebuilt issuer):
    // it is what every other node trusts.
    write_file(out_dir, CA_CERT, &ca_cert_pem, false)?;
    // A CA from before revocation existed has no CRL yet.
    if !ca_dir.join(CA_CRL).exists() {
        revocation::write_crl(ca_dir, &ca_key)?;
    }
    revocation::copy_crl(ca_dir, out_dir)
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
    // Optional (credentials from before revocation have none), but a file
    // QEMU cannot read as a CRL would fail every incoming migration.
    let crl = dir.join(CA_CRL);
    match std::fs::read_to_string(&crl) {
        Ok(text) if !text.contains("-----BEGIN X509 CRL-----") => Err(TlsError::Invalid {
            path: crl,
            reason: "expected PEM with -----BEGIN X509 CRL-----".into(),
        }),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(&crl)(e)),
    }
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
