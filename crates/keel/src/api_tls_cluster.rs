//! One API certificate for every control plane of a cluster on etcd.
//!
//! Why: a CLI pins the certificate it finds in its control plane's data
//! dir (or in its known-servers file); were each control plane to make its
//! own, the CLI would refuse every control plane but one, and a failover
//! would look like someone in between. So the first control plane to start
//! publishes its self-signed certificate and key in the store
//! (create-if-absent, as the shared API token: racing control planes agree
//! on one, the loser takes the winner's), and each writes it into its data
//! dir. The key is as secret as the token already kept there.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{bail, Context};
use keel_store::{Precondition, Store, StoreError};
use serde::{Deserialize, Serialize};

use crate::api_tls;

/// The cluster's self-signed API certificate and key (PEM, as JSON).
pub const API_TLS_KEY: &str = "/config/api-tls";

#[derive(Serialize, Deserialize)]
struct Published {
    cert_pem: String,
    key_pem: String,
}

/// Makes `DATA_DIR/tls/` hold the cluster's API certificate: the store's,
/// else this control plane's (made on first start), published.
pub async fn shared_self_signed(
    store: &dyn Store,
    data_dir: &Path,
    listen: SocketAddr,
) -> anyhow::Result<()> {
    for _ in 0..3 {
        if let Some(entry) = store.get(API_TLS_KEY).await? {
            let published: Published = serde_json::from_slice(&entry.value).with_context(|| {
                format!("the store's {API_TLS_KEY} is not a certificate and key")
            })?;
            api_tls::install_self_signed(data_dir, &published.cert_pem, &published.key_pem)?;
            return Ok(());
        }
        api_tls::ensure_self_signed(data_dir, listen)?;
        let (cert_pem, key_pem) = api_tls::read_self_signed(data_dir)?;
        let value = serde_json::to_vec(&Published { cert_pem, key_pem })?;
        match store.put(API_TLS_KEY, value, Precondition::Absent).await {
            Ok(_) => {
                tracing::info!(key = API_TLS_KEY, "published the cluster's API certificate");
                return Ok(());
            }
            // Another control plane published first: take its certificate.
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    bail!("could not agree on the API certificate at {API_TLS_KEY}: it keeps changing")
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_store::memory::MemoryStore;

    #[tokio::test]
    async fn control_planes_share_the_first_ones_certificate() {
        let store = MemoryStore::new();
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let listen = "127.0.0.1:0".parse().unwrap();
        shared_self_signed(&store, a.path(), listen).await.unwrap();
        shared_self_signed(&store, b.path(), listen).await.unwrap();
        let fp = |dir: &Path| {
            crate::cli::server_trust::cert_file_fingerprint(&api_tls::self_signed_cert_path(dir))
                .unwrap()
        };
        assert_eq!(fp(a.path()), fp(b.path()));
        // The key came along: b can serve with it.
        let id = api_tls::load_identity(&api_tls::ApiTls::SelfSigned, b.path(), listen)
            .unwrap()
            .unwrap();
        assert_eq!(id.fingerprint, fp(a.path()));
    }
}
