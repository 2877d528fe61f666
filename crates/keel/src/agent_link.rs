//! The link from a control plane to a node agent's console port
//! (`keel agent --console-listen`): mutual TLS on the cluster CA
//! (`keel cluster init-ca`), the one that already admits migrations.
//!
//! - The agent serves its node's certificate (`DATA_DIR/migration-tls`,
//!   `keel cluster issue-cert NODE`) and admits only clients with a
//!   certificate of the same CA, not revoked (its CRL), that names
//!   [`tls::CONTROL_PLANE_DNS_NAME`]: a control plane's certificate
//!   (`keel cluster issue-cert NAME --control-plane`). A node's own
//!   certificate does not name it, so one node cannot read another's
//!   consoles.
//! - The control plane verifies that the agent's certificate is of the CA
//!   and names the node the VM runs on, whatever address the node record's
//!   `agent_url` gives: a rewritten record leads it to a TLS handshake it
//!   refuses, never to a request.
//! - The user's token never leaves the control plane: the control plane has
//!   checked it (role, limits, audit) and authenticates to the agent as
//!   itself, naming the token's holder in [`ACTOR_HEADER`] for the agent's
//!   log.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use keel_hv::qemu::tls;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{
    CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName, UnixTime,
};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

use crate::api::ApiError;
use crate::cli::server_trust::ServerTrust;
use crate::http_listener::PeerCertificates;

/// Who asked the control plane for the console: the name of the token's
/// holder, for the agent's log.
pub const ACTOR_HEADER: &str = "x-keel-actor";

/// A server's cluster credentials, in its data dir.
pub fn creds_dir(data_dir: &Path) -> PathBuf {
    data_dir.join(tls::CREDS_DIR)
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The CA to verify peers against, and its revocations.
fn trust_anchors(
    dir: &Path,
) -> anyhow::Result<(
    Arc<RootCertStore>,
    Vec<CertificateRevocationListDer<'static>>,
)> {
    let ca = dir.join(tls::CA_CERT);
    let mut roots = RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(&ca)
        .and_then(|c| c.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("reading {}", ca.display()))?;
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        bail!("{} holds no CA certificate", ca.display());
    }
    let crl = dir.join(tls::CA_CRL);
    let crls = if crl.exists() {
        CertificateRevocationListDer::pem_file_iter(&crl)
            .and_then(|c| c.collect::<Result<Vec<_>, _>>())
            .with_context(|| format!("reading {}", crl.display()))?
    } else {
        Vec::new()
    };
    Ok((Arc::new(roots), crls))
}

fn identity(
    dir: &Path,
    cert: &str,
    key: &str,
) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let (cert, key) = (dir.join(cert), dir.join(key));
    let chain = CertificateDer::pem_file_iter(&cert)
        .and_then(|c| c.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("reading {}", cert.display()))?;
    let key =
        PrivateKeyDer::from_pem_file(&key).with_context(|| format!("reading {}", key.display()))?;
    Ok((chain, key))
}

/// The agent's side: its node certificate, and a client certificate of the
/// cluster CA required of every connection.
pub fn server_config(dir: &Path) -> anyhow::Result<Arc<ServerConfig>> {
    tls::check_creds(dir)?;
    let (roots, crls) = trust_anchors(dir)?;
    let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
        .with_crls(crls)
        .build()
        .context("the cluster CA as a client verifier")?;
    let (chain, key) = identity(dir, tls::SERVER_CERT, tls::SERVER_KEY)?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .context("the node's certificate and key")?;
    Ok(Arc::new(config))
}

/// The control plane's side, towards `node`'s agent: its own certificate,
/// and the agent's verified to be of the CA and to name `node`.
pub fn client_trust(dir: &Path, node: &str) -> anyhow::Result<ServerTrust> {
    tls::check_creds(dir)?;
    let (roots, crls) = trust_anchors(dir)?;
    let inner = WebPkiServerVerifier::builder_with_provider(roots, provider())
        .with_crls(crls)
        .build()
        .context("the cluster CA as a server verifier")?;
    let node = ServerName::try_from(node.to_string())
        .with_context(|| format!("node name {node:?} is not a DNS name"))?;
    let (chain, key) = identity(dir, tls::CLIENT_CERT, tls::CLIENT_KEY)?;
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(NodeVerifier { inner, node }))
        .with_client_auth_cert(chain, key)
        .context("this control plane's certificate and key")?;
    Ok(ServerTrust::Ca {
        config: Arc::new(config),
    })
}

/// The CA's verdict on the certificate, for the node's name rather than
/// the address the URL gives.
#[derive(Debug)]
struct NodeVerifier {
    inner: Arc<WebPkiServerVerifier>,
    node: ServerName<'static>,
}

impl ServerCertVerifier for NodeVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.node, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Whether the client's certificate (already verified against the CA in
/// the handshake) is a control plane's.
fn is_control_plane(certs: &PeerCertificates) -> bool {
    let Some(leaf) = certs.0.first() else {
        return false;
    };
    let Ok(cert) = webpki::EndEntityCert::try_from(leaf) else {
        return false;
    };
    let name = ServerName::try_from(tls::CONTROL_PLANE_DNS_NAME).expect("a DNS name");
    cert.verify_is_valid_for_subject_name(&name).is_ok()
}

/// Middleware of the agent's console port: control planes only.
pub async fn require_control_plane(req: Request, next: Next) -> Response {
    let admitted = req
        .extensions()
        .get::<PeerCertificates>()
        .is_some_and(is_control_plane);
    if !admitted {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "this port serves the cluster's control planes only: a certificate of the cluster CA \
             issued with `keel cluster issue-cert NAME --control-plane`; users reach consoles \
             through a control plane's API",
        )
        .into_response();
    }
    let actor = req
        .headers()
        .get(ACTOR_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("unnamed")
        .to_string();
    tracing::info!(
        actor,
        path = req.uri().path(),
        "console request from a control plane"
    );
    next.run(req).await
}
