//! The API's TLS identity: the certificate `keel serve` presents, and its
//! fingerprint (what the CLI pins).
//!
//! Without configuration the server generates a self-signed certificate
//! into `DATA_DIR/tls/` on first start (key mode 0600) and keeps it across
//! restarts, so a pinned fingerprint stays valid. `--tls-cert/--tls-key`
//! name the operator's own (PEM). Plain HTTP only when asked, and only on
//! loopback.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// How the API listener speaks.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ApiTls {
    /// HTTPS with the certificate of `DATA_DIR/tls/`, made on first start.
    #[default]
    SelfSigned,
    /// HTTPS with the operator's certificate chain and key (PEM files).
    Files { cert: PathBuf, key: PathBuf },
    /// Plain HTTP (`--insecure-http`): loopback only.
    InsecureHttp,
}

/// The directory of the generated certificate.
pub fn tls_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("tls")
}

/// The generated certificate (PEM), which a local CLI pins.
pub fn self_signed_cert_path(data_dir: &Path) -> PathBuf {
    tls_dir(data_dir).join("cert.pem")
}

fn self_signed_key_path(data_dir: &Path) -> PathBuf {
    tls_dir(data_dir).join("key.pem")
}

/// A certificate's fingerprint as the CLI shows and takes it:
/// `sha256:` and the SHA-256 of its DER in lowercase hex.
pub fn fingerprint(cert_der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, cert_der);
    let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A fingerprint as typed: with or without `sha256:`, any case, colons
/// allowed between bytes (as `openssl x509 -fingerprint` prints them).
pub fn parse_fingerprint(text: &str) -> Result<String, String> {
    let t = text.trim();
    let hex = t
        .strip_prefix("sha256:")
        .or_else(|| t.strip_prefix("SHA256:"))
        .or_else(|| t.strip_prefix("sha256="))
        .or_else(|| t.strip_prefix("SHA256="))
        .unwrap_or(t);
    let hex: String = hex.chars().filter(|c| *c != ':').collect();
    if hex.len() != 64 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!(
            "{text:?} is not a SHA-256 fingerprint (64 hex digits, e.g. sha256:3f…)"
        ));
    }
    Ok(format!("sha256:{}", hex.to_ascii_lowercase()))
}

/// Refuses `--insecure-http` beyond loopback.
pub fn check_listen(tls: &ApiTls, listen: SocketAddr) -> anyhow::Result<()> {
    if *tls == ApiTls::InsecureHttp && !listen.ip().is_loopback() {
        bail!(
            "--insecure-http: plain HTTP is allowed only on a loopback address, not {listen}; \
             drop --insecure-http (the API serves HTTPS) or listen on 127.0.0.1 / [::1]"
        );
    }
    Ok(())
}

/// The API's certificate chain and key, ready for the listener, and the
/// leaf's fingerprint; `None` for plain HTTP.
pub struct ServerIdentity {
    pub config: Arc<rustls::ServerConfig>,
    pub fingerprint: String,
}

/// Loads (or on first start generates) the identity `tls` calls for.
pub fn load_identity(
    tls: &ApiTls,
    data_dir: &Path,
    listen: SocketAddr,
) -> anyhow::Result<Option<ServerIdentity>> {
    let (cert_file, key_file) = match tls {
        ApiTls::InsecureHttp => return Ok(None),
        ApiTls::Files { cert, key } => (cert.clone(), key.clone()),
        ApiTls::SelfSigned => {
            ensure_self_signed(data_dir, listen)?;
            (
                self_signed_cert_path(data_dir),
                self_signed_key_path(data_dir),
            )
        }
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert_file)
        .and_then(|certs| certs.collect::<Result<_, _>>())
        .with_context(|| format!("--tls-cert: reading {}", cert_file.display()))?;
    let Some(leaf) = chain.first() else {
        bail!("--tls-cert: {} holds no certificate", cert_file.display());
    };
    let fingerprint = fingerprint(leaf);
    let key = PrivateKeyDer::from_pem_file(&key_file)
        .with_context(|| format!("--tls-key: reading {}", key_file.display()))?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("TLS protocol versions")?
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .with_context(|| {
        format!(
            "--tls-cert/--tls-key: {} and {} do not make a usable pair",
            cert_file.display(),
            key_file.display()
        )
    })?;
    Ok(Some(ServerIdentity {
        config: Arc::new(config),
        fingerprint,
    }))
}

/// The names the generated certificate is valid for: loopback, the host
/// name, and the listen address when it is a specific one.
fn subject_alt_names(listen: SocketAddr) -> Vec<String> {
    let mut names = vec!["localhost".to_string(), "127.0.0.1".into(), "::1".into()];
    if let Some(host) = host_name() {
        names.push(host);
    }
    let ip = listen.ip();
    if !ip.is_unspecified() && !ip.is_loopback() {
        names.push(ip.to_string());
    }
    names.dedup();
    names
}

fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return None;
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    let name = std::str::from_utf8(&buf[..end])
        .ok()?
        .trim()
        .to_ascii_lowercase();
    (!name.is_empty() && name != "localhost").then_some(name)
}

/// Generates `DATA_DIR/tls/{cert,key}.pem` unless both exist. The key is
/// written first, mode 0600, each file in place by rename, so a crash
/// leaves either nothing or a whole pair.
pub fn ensure_self_signed(data_dir: &Path, listen: SocketAddr) -> anyhow::Result<()> {
    let cert_path = self_signed_cert_path(data_dir);
    let key_path = self_signed_key_path(data_dir);
    if cert_path.exists() && key_path.exists() {
        return Ok(());
    }
    let dir = tls_dir(data_dir);
    crate::host::create_private_dir(&dir)?;
    let names = subject_alt_names(listen);
    let mut params =
        rcgen::CertificateParams::new(names.clone()).context("the API certificate's names")?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "keel API (self-signed)");
    let key = rcgen::KeyPair::generate().context("generating the API key")?;
    let cert = params
        .self_signed(&key)
        .context("signing the API certificate")?;
    write_file(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
    write_file(&cert_path, cert.pem().as_bytes(), 0o644)?;
    tracing::info!(
        cert = %cert_path.display(),
        names = ?names,
        "generated the API's self-signed certificate"
    );
    Ok(())
}

/// The generated certificate and key, as PEM.
pub fn read_self_signed(data_dir: &Path) -> anyhow::Result<(String, String)> {
    let read = |p: PathBuf| {
        std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
    };
    Ok((
        read(self_signed_cert_path(data_dir))?,
        read(self_signed_key_path(data_dir))?,
    ))
}

/// Puts `cert_pem` and `key_pem` in place of the generated pair (the
/// cluster's shared one), unless they are there already.
pub fn install_self_signed(data_dir: &Path, cert_pem: &str, key_pem: &str) -> anyhow::Result<()> {
    if read_self_signed(data_dir)
        .ok()
        .as_ref()
        .map(|(c, k)| (c.as_str(), k.as_str()))
        == Some((cert_pem, key_pem))
    {
        return Ok(());
    }
    crate::host::create_private_dir(&tls_dir(data_dir))?;
    write_file(&self_signed_key_path(data_dir), key_pem.as_bytes(), 0o600)?;
    write_file(&self_signed_cert_path(data_dir), cert_pem.as_bytes(), 0o644)?;
    tracing::info!(cert = %self_signed_cert_path(data_dir).display(), "installed the cluster's API certificate");
    Ok(())
}

fn write_file(path: &Path, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_sha256_in_lowercase_hex_and_parse_back() {
        let fp = fingerprint(b"not really a certificate");
        assert!(fp.starts_with("sha256:"));
        assert_eq!(fp.len(), 7 + 64);
        assert_eq!(parse_fingerprint(&fp).unwrap(), fp);
        let hex = &fp[7..];
        assert_eq!(parse_fingerprint(hex).unwrap(), fp);
        let openssl_style: Vec<String> = hex
            .as_bytes()
            .chunks(2)
            .map(|c| String::from_utf8(c.to_vec()).unwrap().to_ascii_uppercase())
            .collect();
        assert_eq!(
            parse_fingerprint(&format!("SHA256:{}", openssl_style.join(":"))).unwrap(),
            fp
        );
        assert!(parse_fingerprint("sha256:abc").is_err());
        assert!(parse_fingerprint(&format!("sha256:{}", "g".repeat(64))).is_err());
    }

    #[test]
    fn insecure_http_is_refused_beyond_loopback() {
        let wide: SocketAddr = "0.0.0.0:7280".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:7280".parse().unwrap();
        let err = check_listen(&ApiTls::InsecureHttp, wide).unwrap_err();
        assert!(err.to_string().contains("--insecure-http"), "{err}");
        check_listen(&ApiTls::InsecureHttp, local).unwrap();
        check_listen(&ApiTls::SelfSigned, wide).unwrap();
    }

    #[test]
    fn the_generated_certificate_is_kept_with_a_private_key() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let listen = "127.0.0.1:0".parse().unwrap();
        let first = load_identity(&ApiTls::SelfSigned, dir.path(), listen)
            .unwrap()
            .unwrap();
        let mode = std::fs::metadata(self_signed_key_path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = load_identity(&ApiTls::SelfSigned, dir.path(), listen)
            .unwrap()
            .unwrap();
        assert_eq!(first.fingerprint, again.fingerprint, "kept across starts");
        let pem = std::fs::read(self_signed_cert_path(dir.path())).unwrap();
        let der = CertificateDer::from_pem_slice(&pem).unwrap();
        assert_eq!(fingerprint(&der), first.fingerprint);
    }
}
