//! Revoking a node's certificates: `keel cluster revoke-cert NODE`.
//!
//! The CA keeps a record of every certificate it issued (`issued.json` in
//! the CA dir: node, serial, expiry, when revoked), so a node can be
//! revoked by name. The revoked serials are published as a CRL signed by
//! the CA key (`ca-crl.pem`), which goes wherever the certificates go: into
//! the CA dir, into a node's credentials at every `issue-cert`, and into the
//! data dirs `revoke-cert` is given. QEMU's `tls-creds-x509` loads
//! `ca-crl.pem` from the credentials dir of a *server* endpoint (QEMU 7.2,
//! `crypto/tlscredsx509.c`, not for a client), so a target refuses a source
//! presenting a revoked certificate; QEMU reads the directory anew for every
//! migration, so a new CRL counts from the next one, without a restart.
//!
//! The CRL's next update is set as far out as the CA lives: gnutls may
//! treat a CRL past its next update as a reason to refuse every peer, and
//! nothing here republishes it on a schedule.

use std::path::{Path, PathBuf};

use rcgen::{
    CertificateRevocationListParams, KeyIdMethod, KeyPair, RevokedCertParams, SerialNumber,
};
use serde::{Deserialize, Serialize};

use super::{ca_params, io_err, owned, write_file, TlsError, CA_KEY, CA_VALID_DAYS, CREDS_DIR};

/// In the CA dir: the certificates it issued.
pub const ISSUED: &str = "issued.json";
/// In the CA dir and every node's credentials dir: the revoked serials.
pub const CA_CRL: &str = "ca-crl.pem";

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IssuedIndex {
    /// The number of the last CRL written (RFC 5280 wants it to grow).
    #[serde(default)]
    pub crl_number: u64,
    #[serde(default)]
    pub certs: Vec<IssuedCert>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IssuedCert {
    pub node: String,
    /// Hex, big-endian, as `openssl x509 -serial` prints it.
    pub serial: String,
    /// Unix seconds.
    pub not_after: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<i64>,
}

pub fn read_index(ca_dir: &Path) -> Result<IssuedIndex, TlsError> {
    let path = ca_dir.join(ISSUED);
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| TlsError::Invalid {
            path,
            reason: format!("not a record of issued certificates: {e}"),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(IssuedIndex::default()),
        Err(e) => Err(io_err(&path)(e)),
    }
}

fn write_index(ca_dir: &Path, index: &IssuedIndex) -> Result<(), TlsError> {
    let text = serde_json::to_string_pretty(index).expect("the index serializes");
    write_file(ca_dir, ISSUED, &text, false)
}

/// A fresh random serial: 16 bytes, positive.
pub(super) fn new_serial() -> Vec<u8> {
    let mut serial: [u8; 16] = rand::random();
    serial[0] = (serial[0] & 0x7f) | 0x01;
    serial.to_vec()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02X}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Records a certificate the CA just issued, before its files are written:
/// a certificate out there is always one `revoke-cert` can name.
pub(super) fn record_issued(
    ca_dir: &Path,
    node: &str,
    serial: &[u8],
    not_after: time::OffsetDateTime,
) -> Result<(), TlsError> {
    let mut index = read_index(ca_dir)?;
    index.certs.push(IssuedCert {
        node: node.to_string(),
        serial: hex(serial),
        not_after: not_after.unix_timestamp(),
        revoked_at: None,
    });
    write_index(ca_dir, &index)
}

/// Writes the CA's CRL (`ca-dir/ca-crl.pem`) from its record: every
/// revoked certificate that has not yet expired.
pub(super) fn write_crl(ca_dir: &Path, ca_key: &KeyPair) -> Result<(), TlsError> {
    let mut index = read_index(ca_dir)?;
    let now = time::OffsetDateTime::now_utc();
    let mut revoked = Vec::new();
    for cert in &index.certs {
        let Some(at) = cert.revoked_at else { continue };
        if cert.not_after < now.unix_timestamp() {
            continue;
        }
        let serial = unhex(&cert.serial).ok_or_else(|| TlsError::Invalid {
            path: ca_dir.join(ISSUED),
            reason: format!("serial {:?} of node {} is not hex", cert.serial, cert.node),
        })?;
        revoked.push(RevokedCertParams {
            serial_number: SerialNumber::from(serial),
            revocation_time: time::OffsetDateTime::from_unix_timestamp(at).unwrap_or(now),
            reason_code: None,
            invalidity_date: None,
        });
    }
    index.crl_number += 1;
    let issuer = ca_params()?
        .self_signed(ca_key)
        .map_err(|source| TlsError::Generate {
            what: "CA issuer",
            source,
        })?;
    let crl = CertificateRevocationListParams {
        // An hour back, as for certificates: a peer a little behind still
        // takes it as issued.
        this_update: now - time::Duration::hours(1),
        next_update: now + time::Duration::days(CA_VALID_DAYS),
        crl_number: SerialNumber::from(index.crl_number),
        issuing_distribution_point: None,
        revoked_certs: revoked,
        key_identifier_method: KeyIdMethod::Sha256,
    }
    .signed_by(&issuer, ca_key)
    .map_err(|source| TlsError::Generate {
        what: "CRL",
        source,
    })?;
    let pem = crl.pem().map_err(|source| TlsError::Generate {
        what: "CRL",
        source,
    })?;
    write_index(ca_dir, &index)?;
    write_file(ca_dir, CA_CRL, &pem, false)
}

/// Copies the CA's CRL into a node's credentials dir, if the CA has one.
pub(super) fn copy_crl(ca_dir: &Path, creds_dir: &Path) -> Result<(), TlsError> {
    let from = ca_dir.join(CA_CRL);
    let pem = match std::fs::read_to_string(&from) {
        Ok(pem) => pem,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(&from)(e)),
    };
    write_file(creds_dir, CA_CRL, &pem, false)
}

/// What `revoke` did: the serials it revoked, and the credentials dirs it
/// wrote the new CRL into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revoked {
    pub serials: Vec<String>,
    pub distributed: Vec<PathBuf>,
}

/// Revokes every certificate the CA issued to `node` so far, writes the
/// CA's new CRL, and copies it into the migration credentials of each of
/// `data_dirs` (nodes' data dirs). A certificate issued afterwards is a
/// new one and is not revoked.
pub fn revoke(ca_dir: &Path, node: &str, data_dirs: &[PathBuf]) -> Result<Revoked, TlsError> {
    owned(ca_dir)?;
    let ca_key = super::read_ca_key(ca_dir)?;
    let mut index = read_index(ca_dir)?;
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let mut serials = Vec::new();
    for cert in index.certs.iter_mut().filter(|c| c.node == node) {
        if cert.revoked_at.is_none() {
            cert.revoked_at = Some(now);
            serials.push(cert.serial.clone());
        }
    }
    if serials.is_empty() {
        let ever = index.certs.iter().any(|c| c.node == node);
        return Err(TlsError::Invalid {
            path: ca_dir.join(ISSUED),
            reason: if ever {
                format!("every certificate of node {node} is revoked already")
            } else {
                format!(
                    "no certificate of node {node} is recorded (issued before the CA kept \
                     {ISSUED}, or by another CA); replace it with a new issue-cert, or \
                     the CA ({CA_KEY}) to shut it out"
                )
            },
        });
    }
    write_index(ca_dir, &index)?;
    write_crl(ca_dir, &ca_key)?;
    let mut distributed = Vec::new();
    for data_dir in data_dirs {
        let creds = data_dir.join(CREDS_DIR);
        owned(&creds)?;
        copy_crl(ca_dir, &creds)?;
        distributed.push(creds);
    }
    Ok(Revoked {
        serials,
        distributed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_read_back_as_written() {
        let s = new_serial();
        assert_eq!(s.len(), 16);
        assert!(s[0] & 0x80 == 0 && s[0] != 0);
        assert_eq!(unhex(&hex(&s)).unwrap(), s);
        assert_eq!(unhex("0"), None);
        assert_eq!(unhex("zz"), None);
    }

    #[test]
    fn revoking_a_node_lists_its_certificates_until_then_not_later_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let ca = tmp.path().join("ca");
        super::super::init_ca(&ca).unwrap();
        let empty_crl = std::fs::read_to_string(ca.join(CA_CRL)).unwrap();
        assert!(
            empty_crl.contains("-----BEGIN X509 CRL-----"),
            "{empty_crl}"
        );
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        super::super::issue(&ca, "a", &a.join(CREDS_DIR)).unwrap();
        super::super::issue(&ca, "b", &b.join(CREDS_DIR)).unwrap();
        assert_eq!(
            std::fs::read_to_string(b.join(CREDS_DIR).join(CA_CRL)).unwrap(),
            empty_crl,
            "issue-cert hands out the CA's CRL"
        );

        let done = revoke(&ca, "a", std::slice::from_ref(&b)).unwrap();
        assert_eq!(done.serials.len(), 1);
        let index = read_index(&ca).unwrap();
        let [first_a, _] = index.certs.as_slice() else {
            panic!("{index:?}");
        };
        assert_eq!(done.serials[0], first_a.serial);
        assert_eq!(index.crl_number, 2);
        let crl = std::fs::read_to_string(ca.join(CA_CRL)).unwrap();
        assert_ne!(crl, empty_crl);
        assert_eq!(
            std::fs::read_to_string(b.join(CREDS_DIR).join(CA_CRL)).unwrap(),
            crl,
            "the new CRL reaches the data dirs given"
        );
        let again = revoke(&ca, "a", &[]).unwrap_err().to_string();
        assert!(again.contains("revoked already"), "{again}");
        let unknown = revoke(&ca, "nobody", &[]).unwrap_err().to_string();
        assert!(
            unknown.contains("no certificate of node nobody"),
            "{unknown}"
        );

        // Reissued after the revocation: a new serial, not on the CRL.
        super::super::issue(&ca, "a", &a.join(CREDS_DIR)).unwrap();
        let index = read_index(&ca).unwrap();
        let reissued = index.certs.last().unwrap();
        assert_eq!((reissued.node.as_str(), reissued.revoked_at), ("a", None));
        assert_ne!(reissued.serial, first_a.serial);
        assert_eq!(
            std::fs::read_to_string(a.join(CREDS_DIR).join(CA_CRL)).unwrap(),
            crl
        );
    }
}
