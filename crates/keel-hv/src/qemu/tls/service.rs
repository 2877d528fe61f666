//! Certificates from the cluster CA for the services around Keel rather
//! than for a node's migrations: etcd's server certificate (its client
//! URLs' IP addresses and DNS names as SANs), the client certificates
//! `keel serve`/`keel agent` present to an etcd run with
//! `--client-cert-auth`, and the API certificate the control planes of a
//! cluster serve with `--tls-cert/--tls-key` (every one the same names, so
//! a CLI with `--ca-file` trusts whichever answers, through a failover). One CA for the cluster: the operator keeps one
//! key private, and a certificate of another CA is refused by etcd.
//!
//! A server certificate carries both TLS purposes: etcd 3.4's own gRPC
//! gateway dials etcd with the server certificate as its client
//! certificate, which etcd then checks like any client's. A client
//! certificate carries clientAuth only, so it cannot impersonate etcd.

use std::net::IpAddr;
use std::path::Path;

use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};

use super::{
    ca_params, owned, private_dir, read_ca_key, revocation, validity, write_file, TlsError,
    CA_CERT, MAX_NODE_VALID_DAYS,
};

/// What the certificate is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServiceRole {
    /// etcd's server side (serverAuth, and clientAuth for its gateway).
    EtcdServer,
    /// A client of etcd: `keel serve`, `keel agent` (clientAuth).
    EtcdClient,
    /// The HTTPS API of `keel serve` (serverAuth only).
    ApiServer,
}

impl ServiceRole {
    fn is_server(self) -> bool {
        matches!(self, ServiceRole::EtcdServer | ServiceRole::ApiServer)
    }
}

/// The files [`issue_service`] writes into its output directory.
pub fn cert_file(name: &str) -> String {
    format!("{name}-cert.pem")
}

pub fn key_file(name: &str) -> String {
    format!("{name}-key.pem")
}

/// Issues `name`'s certificate for `role` from the CA in `ca_dir` into
/// `out_dir` (`NAME-cert.pem`, `NAME-key.pem` mode 0600, and the CA's
/// `ca-cert.pem`). A server certificate names `ips` and `dns` (and `name`
/// as a DNS name) as its subject alternative names; it needs at least one
/// of them other than `name` when etcd is reached by address. Issuing again
/// renews it.
pub fn issue_service(
    ca_dir: &Path,
    name: &str,
    role: ServiceRole,
    ips: &[IpAddr],
    dns: &[String],
    out_dir: &Path,
    days: u32,
) -> Result<(), TlsError> {
    let invalid = |reason: String| TlsError::Invalid {
        path: out_dir.to_path_buf(),
        reason,
    };
    keel_api::validate_name("name", name).map_err(|e| invalid(e.to_string()))?;
    if !(1..=MAX_NODE_VALID_DAYS).contains(&days) {
        return Err(invalid(format!(
            "valid days {days}: expected 1-{MAX_NODE_VALID_DAYS}"
        )));
    }
    if !role.is_server() && (!ips.is_empty() || !dns.is_empty()) {
        return Err(invalid(
            "a client certificate names no addresses (--ip/--dns are for --etcd-server and --api-server)".into(),
        ));
    }
    owned(ca_dir)?;
    let ca_cert_path = ca_dir.join(CA_CERT);
    let ca_cert_pem = std::fs::read_to_string(&ca_cert_path).map_err(|source| TlsError::Io {
        path: ca_cert_path.clone(),
        source,
    })?;
    let ca_key = read_ca_key(ca_dir)?;
    let issuer = ca_params()?
        .self_signed(&ca_key)
        .map_err(|source| TlsError::Generate {
            what: "CA issuer",
            source,
        })?;
    let key = KeyPair::generate().map_err(|source| TlsError::Generate {
        what: "service key",
        source,
    })?;
    let mut params =
        CertificateParams::new(Vec::<String>::new()).map_err(|source| TlsError::Generate {
            what: "service certificate",
            source,
        })?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    let mut sans = Vec::new();
    if role.is_server() {
        for host in std::iter::once(name).chain(dns.iter().map(String::as_str)) {
            sans.push(SanType::DnsName(host.try_into().map_err(|e| {
                invalid(format!("{host:?} is not a DNS name: {e}"))
            })?));
        }
        sans.extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
    }
    params.subject_alt_names = sans;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = match role {
        ServiceRole::EtcdServer => vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
        ServiceRole::EtcdClient => vec![ExtendedKeyUsagePurpose::ClientAuth],
        ServiceRole::ApiServer => vec![ExtendedKeyUsagePurpose::ServerAuth],
    };
    params.use_authority_key_identifier_extension = true;
    let serial = revocation::new_serial();
    params.serial_number = Some(SerialNumber::from(serial.clone()));
    validity(&mut params, i64::from(days));
    let not_after = params.not_after;
    let cert = params
        .signed_by(&key, &issuer, &ca_key)
        .map_err(|source| TlsError::Generate {
            what: "service certificate",
            source,
        })?;
    private_dir(out_dir)?;
    revocation::record_issued(ca_dir, name, &serial, not_after)?;
    write_file(out_dir, &key_file(name), &key.serialize_pem(), true)?;
    write_file(out_dir, &cert_file(name), &cert.pem(), false)?;
    write_file(out_dir, CA_CERT, &ca_cert_pem, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn der(pem: &str) -> Vec<u8> {
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        use base64::Engine;
        base64::engine::general_purpose::STANDARD
            .decode(body)
            .unwrap()
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    // DER of the EKU purposes' OIDs: 1.3.6.1.5.5.7.3.1 / .2.
    const SERVER_AUTH: &[u8] = &[0x2b, 6, 1, 5, 5, 7, 3, 1];
    const CLIENT_AUTH: &[u8] = &[0x2b, 6, 1, 5, 5, 7, 3, 2];

    #[test]
    fn server_names_its_addresses_and_client_is_client_only() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca");
        super::super::init_ca(&ca).unwrap();
        let out = dir.path().join("etcd-tls");
        let loopback: IpAddr = "127.0.0.1".parse().unwrap();
        issue_service(
            &ca,
            "etcd",
            ServiceRole::EtcdServer,
            &[loopback],
            &[],
            &out,
            30,
        )
        .unwrap();
        issue_service(&ca, "keel", ServiceRole::EtcdClient, &[], &[], &out, 30).unwrap();

        let server = der(&std::fs::read_to_string(out.join(cert_file("etcd"))).unwrap());
        // An IP SAN is the context tag [7] with the four address bytes.
        assert!(
            contains(&server, &[0x87, 4, 127, 0, 0, 1]),
            "no IP SAN 127.0.0.1"
        );
        assert!(contains(&server, SERVER_AUTH) && contains(&server, CLIENT_AUTH));
        let client = der(&std::fs::read_to_string(out.join(cert_file("keel"))).unwrap());
        assert!(contains(&client, CLIENT_AUTH) && !contains(&client, SERVER_AUTH));
        assert!(out.join(CA_CERT).exists());
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(out.join(key_file("keel")))
                .unwrap()
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);

        let err = issue_service(
            &ca,
            "keel",
            ServiceRole::EtcdClient,
            &[loopback],
            &[],
            &out,
            30,
        )
        .unwrap_err();
        assert!(err.to_string().contains("--ip"), "{err}");
    }

    #[test]
    fn an_api_certificate_serves_only() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca");
        super::super::init_ca(&ca).unwrap();
        let out = dir.path().join("api-tls");
        let loopback: IpAddr = "127.0.0.1".parse().unwrap();
        issue_service(
            &ca,
            "keel-api",
            ServiceRole::ApiServer,
            &[loopback],
            &["keel.example".to_string()],
            &out,
            30,
        )
        .unwrap();
        let api = der(&std::fs::read_to_string(out.join(cert_file("keel-api"))).unwrap());
        assert!(contains(&api, &[0x87, 4, 127, 0, 0, 1]), "no IP SAN");
        assert!(contains(&api, b"keel.example"), "no DNS SAN");
        assert!(contains(&api, SERVER_AUTH) && !contains(&api, CLIENT_AUTH));
    }
}
