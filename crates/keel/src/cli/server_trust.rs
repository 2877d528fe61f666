//! Whom the CLI trusts to be the keel server: the TLS side of the client.
//!
//! In order:
//! - `--ca-file`: the server's chain must lead to that CA and name the
//!   host of `--server` (operator certificates, `--tls-cert`).
//! - Else a pinned fingerprint (SHA-256 of the server's certificate): the
//!   certificate in the server's data dir (`DATA_DIR/tls/cert.pem`, when
//!   the CLI can read it — it reads the token there too: a local operator
//!   needs no first-use step), and the pin stored for this server in the
//!   known-servers file (`~/.config/keel/known_servers`, like SSH's
//!   known_hosts). The server must present one of them; a different one is
//!   refused, naming the server, both fingerprints and how to re-pin.
//! - Else (first contact with a remote server): the CLI fetches the
//!   certificate and pins it only with consent: `--accept-fingerprint`
//!   matching it, or a yes on a terminal. Without a terminal, first contact
//!   is refused with the fingerprint shown: a script must never trust
//!   whoever answers first, since that may be someone in between.
//!
//! A pin trusts one certificate, whatever names it carries (a self-signed
//! certificate lists the names the server knew at its first start), so the
//! host name is not checked against it; the handshake's signature is.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{BufRead, IsTerminal, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, DigitallySignedStruct, SignatureScheme, StreamOwned};
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, Either, LazyBuffers, NextTimeout, TcpConnector,
    Transport, TransportAdapter,
};

use super::literal_resolver::LiteralResolver;
use crate::api_tls::{fingerprint, self_signed_cert_path};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the CLI needs to decide whom to trust (from [`crate::args::ClientArgs`]).
#[derive(Debug, Clone, Default)]
pub struct TrustArgs {
    /// Verify against this CA instead of pinning.
    pub ca_file: Option<PathBuf>,
    /// Pin (or re-pin) the server's certificate if it has this fingerprint.
    pub accept_fingerprint: Option<String>,
    /// The known-servers file; default [`default_known_servers`].
    pub known_servers: Option<PathBuf>,
    /// The server's data dir, whose certificate a local CLI trusts.
    pub data_dir: Option<PathBuf>,
}

/// `$XDG_CONFIG_HOME/keel/known_servers`, else `~/.config/keel/known_servers`.
pub fn default_known_servers() -> PathBuf {
    let config = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(|| PathBuf::from("."));
    config.join("keel").join("known_servers")
}

/// The pins of remote servers: one `HOST:PORT sha256:HEX` a line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KnownServers {
    pins: BTreeMap<String, String>,
}

impl KnownServers {
    /// An absent file knows no server.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(&text).with_context(|| format!("{}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let mut pins = BTreeMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(server), Some(fp), None) = (words.next(), words.next(), words.next()) else {
                bail!("line {}: expected `HOST:PORT sha256:FINGERPRINT`", n + 1);
            };
            let fp = crate::api_tls::parse_fingerprint(fp)
                .map_err(|e| anyhow::anyhow!("line {}: {e}", n + 1))?;
            pins.insert(server.to_ascii_lowercase(), fp);
        }
        Ok(Self { pins })
    }

    pub fn get(&self, server: &str) -> Option<&str> {
        self.pins
            .get(&server.to_ascii_lowercase())
            .map(String::as_str)
    }

    pub fn pin(&mut self, server: &str, fingerprint: &str) {
        self.pins
            .insert(server.to_ascii_lowercase(), fingerprint.to_string());
    }

    pub fn render(&self) -> String {
        let mut out = String::from(
            "# Keel servers whose certificates this user trusts: HOST:PORT sha256:FINGERPRINT\n",
        );
        for (server, fp) in &self.pins {
            out.push_str(&format!("{server} {fp}\n"));
        }
        out
    }

    /// Writes the file whole (mode 0600, by rename), creating its directory.
    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let tmp = path.with_extension("tmp");
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(self.render().as_bytes())
            .and_then(|()| f.sync_all())
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
    }
}

/// Where an accepted fingerprint comes from, for the messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinSource {
    DataDir(PathBuf),
    KnownServers(PathBuf),
}

impl fmt::Display for PinSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PinSource::DataDir(p) => write!(f, "the server certificate in {}", p.display()),
            PinSource::KnownServers(p) => write!(f, "the pin stored for it in {}", p.display()),
        }
    }
}

/// Accepts exactly the certificates of `pins`, and records what it saw.
#[derive(Debug)]
pub struct PinVerifier {
    pins: Vec<(String, PinSource)>,
    seen: Mutex<Option<String>>,
    provider: Arc<CryptoProvider>,
}

impl PinVerifier {
    fn new(pins: Vec<(String, PinSource)>) -> Self {
        Self {
            pins,
            seen: Mutex::new(None),
            provider: provider(),
        }
    }

    /// The fingerprint of the last certificate a server presented.
    pub fn seen(&self) -> Option<String> {
        self.seen.lock().expect("seen").clone()
    }
}

impl ServerCertVerifier for PinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let fp = fingerprint(end_entity);
        let known = self.pins.iter().any(|(pin, _)| *pin == fp);
        *self.seen.lock().expect("seen") = Some(fp);
        if known {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    // The signatures prove the server holds the pinned certificate's key.
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// How the CLI verifies the server it talks to.
#[derive(Debug, Clone)]
pub enum ServerTrust {
    /// `http://` (a loopback server run with `--insecure-http`).
    PlainHttp,
    /// Verified against the CA of `--ca-file`, host name included.
    Ca { config: Arc<ClientConfig> },
    /// One of these certificates, by fingerprint.
    Pinned {
        config: Arc<ClientConfig>,
        verifier: Arc<PinVerifier>,
    },
}

impl ServerTrust {
    /// A pin on these fingerprints (tests and tools that read the server's
    /// certificate themselves).
    pub fn pinned(pins: Vec<(String, PinSource)>) -> Self {
        let verifier = Arc::new(PinVerifier::new(pins));
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .dangerous()
            .with_custom_certificate_verifier(verifier.clone())
            .with_no_client_auth();
        ServerTrust::Pinned {
            config: Arc::new(config),
            verifier,
        }
    }

    /// Trusting the certificate in the server's data dir `data_dir`.
    pub fn of_data_dir(data_dir: &Path) -> anyhow::Result<Self> {
        let path = self_signed_cert_path(data_dir);
        let fp = cert_file_fingerprint(&path)?;
        Ok(Self::pinned(vec![(fp, PinSource::DataDir(path))]))
    }

    pub fn from_ca_file(path: &Path) -> anyhow::Result<Self> {
        let mut roots = rustls::RootCertStore::empty();
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|c| c.collect::<Result<Vec<_>, _>>())
            .with_context(|| format!("--ca-file: reading {}", path.display()))?;
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            bail!("--ca-file: {} holds no CA certificate", path.display());
        }
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(ServerTrust::Ca {
            config: Arc::new(config),
        })
    }

    /// The rustls configuration (the console's WebSocket uses it too).
    pub fn client_config(&self) -> Option<Arc<ClientConfig>> {
        match self {
            ServerTrust::PlainHttp => None,
            ServerTrust::Ca { config } | ServerTrust::Pinned { config, .. } => Some(config.clone()),
        }
    }

    /// A clear message for a failed connection to `server` that a pin
    /// refused; `None` if the failure was something else.
    pub fn refusal(&self, server: &str) -> Option<String> {
        let ServerTrust::Pinned { verifier, .. } = self else {
            return None;
        };
        let seen = verifier.seen()?;
        if verifier.pins.iter().any(|(pin, _)| *pin == seen) {
            return None;
        }
        let expected: Vec<String> = verifier
            .pins
            .iter()
            .map(|(pin, source)| format!("{pin} ({source})"))
            .collect();
        Some(format!(
            "refusing the keel server at {server}: it presented a certificate with fingerprint {seen}, \
             but the certificate trusted for it is {}. Either the server's certificate was replaced \
             or someone is in between. Check the new fingerprint with the server's operator \
             (`keel serve` logs it at start as fingerprint=…); if it is right, re-pin it with \
             --accept-fingerprint {seen}",
            expected.join(" or ")
        ))
    }

    /// A ureq agent that speaks TLS with this trust.
    pub fn agent(&self, config: ureq::config::Config) -> ureq::Agent {
        let connector = ().chain(TcpConnector::default()).chain(TlsConnector {
            config: self.client_config(),
        });
        ureq::Agent::with_parts(config, connector, LiteralResolver::default())
    }
}

/// The fingerprint of the first certificate in a PEM file.
pub fn cert_file_fingerprint(path: &Path) -> anyhow::Result<String> {
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let der = CertificateDer::from_pem_slice(&pem)
        .with_context(|| format!("{}: no PEM certificate", path.display()))?;
    Ok(fingerprint(&der))
}

/// `HOST:PORT` of an `https://` URL (port 443 if none), and its host.
pub fn authority(server: &str) -> anyhow::Result<(String, String)> {
    let uri: ureq::http::Uri = server
        .parse()
        .with_context(|| format!("--server {server}: not a URL"))?;
    let host = uri
        .host()
        .with_context(|| format!("--server {server}: no host"))?
        .to_string();
    let port = uri.port_u16().unwrap_or(443);
    let authority = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    Ok((authority.to_ascii_lowercase(), host))
}

/// Decides whom to trust as the server at `server` (an `https://` URL),
/// fetching its certificate for a first contact.
pub fn establish(server: &str, args: &TrustArgs) -> anyhow::Result<ServerTrust> {
    if server.starts_with("http://") {
        return Ok(ServerTrust::PlainHttp);
    }
    if let Some(ca) = &args.ca_file {
        return ServerTrust::from_ca_file(ca);
    }
    let (authority, host) = authority(server)?;
    let known_path = args
        .known_servers
        .clone()
        .unwrap_or_else(default_known_servers);
    let mut known = KnownServers::load(&known_path)?;
    let mut pins = Vec::new();
    if let Some(dir) = &args.data_dir {
        let path = self_signed_cert_path(dir);
        if let Ok(fp) = cert_file_fingerprint(&path) {
            pins.push((fp, PinSource::DataDir(path)));
        }
    }
    if let Some(fp) = known.get(&authority) {
        pins.push((fp.to_string(), PinSource::KnownServers(known_path.clone())));
    }
    let accept = args
        .accept_fingerprint
        .as_deref()
        .map(crate::api_tls::parse_fingerprint)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--accept-fingerprint: {e}"))?;
    if accept.is_none() && !pins.is_empty() {
        return Ok(ServerTrust::pinned(pins));
    }
    let presented = fetch_fingerprint(&authority, &host)
        .with_context(|| format!("cannot reach the keel server at {server} to fetch its certificate; is `keel serve` running? (set --server or $KEEL_SERVER)"))?;
    if pins.iter().any(|(pin, _)| *pin == presented) {
        return Ok(ServerTrust::pinned(pins));
    }
    let consent = match &accept {
        Some(accept) if *accept == presented => true,
        Some(accept) => bail!(
            "--accept-fingerprint: the keel server at {authority} presented a certificate with \
             fingerprint {presented}, not {accept}; nothing was pinned"
        ),
        None if !pins.is_empty() => unreachable!("returned above"),
        None => ask(&authority, &presented, &known_path)?,
    };
    if !consent {
        bail!("the keel server at {authority} was not trusted; nothing was pinned");
    }
    known.pin(&authority, &presented);
    known.save(&known_path)?;
    eprintln!(
        "keel: pinned {authority} as {presented} in {}",
        known_path.display()
    );
    Ok(ServerTrust::pinned(vec![(
        presented,
        PinSource::KnownServers(known_path),
    )]))
}

/// Asks on a terminal whether to trust `fp`; without one, refuses.
fn ask(authority: &str, fp: &str, known_path: &Path) -> anyhow::Result<bool> {
    if !(std::io::stdin().is_terminal() && std::io::stderr().is_terminal()) {
        bail!(
            "the keel server at {authority} is not known yet; its certificate's fingerprint is {fp}. \
             Check it with the server's operator (`keel serve` logs it at start as fingerprint=…, \
             and it is the SHA-256 of DATA_DIR/tls/cert.pem), then pass --accept-fingerprint {fp} \
             once to pin it in {}; or pass --ca-file if the server's certificate is issued by your CA",
            known_path.display()
        );
    }
    eprint!(
        "The keel server at {authority} is not known yet.\nIts certificate's fingerprint is {fp}.\n\
         Trust it from now on (pinned in {})? [y/N] ",
        known_path.display()
    );
    let _ = std::io::stderr().flush();
    // One line (a terminal sends it on Enter), at most 64 bytes of it;
    // read_to_string would wait for an end of file that never comes.
    let mut line = String::new();
    let _ = std::io::stdin().lock().take(64).read_line(&mut line);
    let line = line
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    Ok(line == "y" || line == "yes")
}

/// The fingerprint of the certificate the server at `authority` presents,
/// from a handshake that trusts nothing.
pub fn fetch_fingerprint(authority: &str, host: &str) -> anyhow::Result<String> {
    let addr = authority
        .to_socket_addrs()
        .with_context(|| format!("resolving {authority}"))?
        .next()
        .with_context(|| format!("{authority}: no address"))?;
    let mut tcp = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .with_context(|| format!("connecting to {authority}"))?;
    tcp.set_read_timeout(Some(CONNECT_TIMEOUT))?;
    tcp.set_write_timeout(Some(CONNECT_TIMEOUT))?;
    let ServerTrust::Pinned { config, verifier } = ServerTrust::pinned(Vec::new()) else {
        unreachable!("pinned() makes a pin");
    };
    let name = server_name(host)?;
    let mut conn = ClientConnection::new(config, name).context("starting TLS")?;
    // The handshake fails at the (empty) pin, after the certificate is seen.
    let handshake = conn.complete_io(&mut tcp);
    match (verifier.seen(), handshake) {
        (Some(fp), _) => Ok(fp),
        (None, Err(e)) => {
            Err(e).with_context(|| format!("TLS handshake with {authority} (does it speak HTTPS?)"))
        }
        (None, Ok(_)) => bail!("{authority} presented no certificate"),
    }
}

fn server_name(host: &str) -> anyhow::Result<ServerName<'static>> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(bare.to_string()).with_context(|| format!("{host}: not a host name"))
}

/// The TLS layer of the CLI's ureq agents, on [`ServerTrust`]'s rustls
/// configuration (ureq's own takes no custom verifier).
#[derive(Debug)]
struct TlsConnector {
    config: Option<Arc<ClientConfig>>,
}

impl<In: Transport> Connector<In> for TlsConnector {
    type Out = Either<In, TlsTransport>;

    fn connect(
        &self,
        details: &ConnectionDetails,
        chained: Option<In>,
    ) -> Result<Option<Self::Out>, ureq::Error> {
        let Some(transport) = chained else {
            return Ok(None);
        };
        if !details.needs_tls() || transport.is_tls() {
            return Ok(Some(Either::A(transport)));
        }
        let Some(config) = &self.config else {
            return Err(ureq::Error::Tls("https needs a TLS configuration"));
        };
        let host = details
            .uri
            .host()
            .ok_or(ureq::Error::Tls("https URL without a host"))?;
        let name = server_name(host).map_err(|_| ureq::Error::Tls("invalid server name"))?;
        let mut conn = ClientConnection::new(config.clone(), name)
            .map_err(|e| ureq::Error::Io(std::io::Error::other(e)))?;
        let mut sock = TransportAdapter::new(transport.boxed(), details.current_time.clone());
        sock.set_timeout(details.timeout);
        conn.complete_io(&mut sock)?;
        Ok(Some(Either::B(TlsTransport {
            buffers: LazyBuffers::new(
                details.config.input_buffer_size(),
                details.config.output_buffer_size(),
            ),
            stream: StreamOwned { conn, sock },
        })))
    }
}

struct TlsTransport {
    buffers: LazyBuffers,
    stream: StreamOwned<ClientConnection, TransportAdapter>,
}

impl fmt::Debug for TlsTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsTransport").finish()
    }
}

impl Transport for TlsTransport {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        self.stream.get_mut().set_timeout(timeout);
        let output = &self.buffers.output()[..amount];
        self.stream.write_all(output)?;
        Ok(())
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        self.stream.get_mut().set_timeout(timeout);
        let input = self.buffers.input_append_buf();
        let amount = self.stream.read(input)?;
        self.buffers.input_appended(amount);
        Ok(amount > 0)
    }

    fn is_open(&mut self) -> bool {
        self.stream.get_mut().get_mut().is_open()
    }

    fn is_tls(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP_A: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const FP_B: &str = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    #[test]
    fn the_pin_store_round_trips_and_replaces_a_pin() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/known_servers");
        assert_eq!(KnownServers::load(&path).unwrap(), KnownServers::default());
        let mut known = KnownServers::default();
        known.pin("Keel.Example:7280", FP_A);
        known.pin("[::1]:7280", FP_B);
        known.save(&path).unwrap();
        let again = KnownServers::load(&path).unwrap();
        assert_eq!(again.get("keel.example:7280"), Some(FP_A));
        assert_eq!(again.get("[::1]:7280"), Some(FP_B));
        assert_eq!(again.get("keel.example:7281"), None);
        let mut again = again;
        again.pin("keel.example:7280", FP_B);
        assert_eq!(again.get("keel.example:7280"), Some(FP_B));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_damaged_pin_store_names_the_line() {
        let err = KnownServers::parse("# c\nhost:1 sha256:zz\n").unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        let err = KnownServers::parse("host:1\n").unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
    }

    #[test]
    fn authorities_have_a_port() {
        assert_eq!(
            authority("https://Keel.Example").unwrap().0,
            "keel.example:443"
        );
        assert_eq!(
            authority("https://127.0.0.1:7280/").unwrap().0,
            "127.0.0.1:7280"
        );
        assert_eq!(authority("https://[::1]:7280").unwrap().0, "[::1]:7280");
    }

    #[test]
    fn a_refusal_names_both_fingerprints_and_how_to_re_pin() {
        let trust = ServerTrust::pinned(vec![(FP_A.into(), PinSource::KnownServers("/k".into()))]);
        let ServerTrust::Pinned { verifier, .. } = &trust else {
            unreachable!()
        };
        assert_eq!(trust.refusal("h:1"), None, "nothing seen yet");
        *verifier.seen.lock().unwrap() = Some(FP_B.into());
        let msg = trust.refusal("h:1").unwrap();
        assert!(
            msg.contains("h:1") && msg.contains(FP_A) && msg.contains(FP_B),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("--accept-fingerprint {FP_B}")),
            "{msg}"
        );
        assert!(msg.contains("/k"), "{msg}");
    }
}
