//! The API certificate of a control plane on etcd: its own, never in the
//! store.
//!
//! Why: a reader of etcd must learn no credential, and a TLS key is one
//! (whoever holds it can stand in for the API and collect every token sent
//! to it). So without `--tls-cert/--tls-key` each control plane makes its
//! own self-signed certificate in its data dir, which the CLI pins per
//! server (`HOST:PORT`). A cluster reached at one address (a VIP, a DNS
//! name over several control planes) gives them all one certificate
//! instead: `keel cluster issue-cert NAME --api-server --dns … --ip …`,
//! served with `--tls-cert/--tls-key`, checked by clients with `--ca-file`.
//!
//! Before this, the first control plane published its self-signed
//! certificate *and key* at [`LEGACY_API_TLS_KEY`] for the others to share.
//! An upgraded control plane keeps that certificate if its data dir has no
//! other (so the pins its clients made stay good) and deletes the store's
//! copy.

use std::path::Path;

use anyhow::Context;
use keel_store::{Store, StoreError};
use serde::Deserialize;

use crate::api_tls;

/// Where earlier versions published the shared self-signed certificate and
/// its key (PEM, as JSON).
pub const LEGACY_API_TLS_KEY: &str = "/config/api-tls";

#[derive(Deserialize)]
struct Published {
    cert_pem: String,
    key_pem: String,
}

/// Takes the key an earlier version left in the store out of it, keeping
/// its certificate in `data_dir` when this control plane has none of its
/// own yet. Returns whether there was one.
pub async fn withdraw_published_key(store: &dyn Store, data_dir: &Path) -> anyhow::Result<bool> {
    let Some(entry) = store.get(LEGACY_API_TLS_KEY).await? else {
        return Ok(false);
    };
    if api_tls::read_self_signed(data_dir).is_err() {
        let published: Published = serde_json::from_slice(&entry.value).with_context(|| {
            format!("the store's {LEGACY_API_TLS_KEY} is not a certificate and key")
        })?;
        api_tls::install_self_signed(data_dir, &published.cert_pem, &published.key_pem)?;
    }
    match store.delete(LEGACY_API_TLS_KEY, entry.mod_revision).await {
        Ok(_) => tracing::warn!(
            key = LEGACY_API_TLS_KEY,
            "deleted the API certificate's private key an earlier version kept in the store: \
             each control plane now keeps its own; give them one with --tls-cert/--tls-key \
             (keel cluster issue-cert NAME --api-server) if clients reach them at one address"
        ),
        // Another control plane deleted it first.
        Err(StoreError::Conflict { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_store::memory::MemoryStore;
    use keel_store::Precondition;

    /// What an earlier version stored: `dir`'s certificate and key.
    async fn publish_as_before(store: &MemoryStore, dir: &Path) {
        let (cert_pem, key_pem) = api_tls::read_self_signed(dir).unwrap();
        let value = serde_json::json!({"cert_pem": cert_pem, "key_pem": key_pem});
        store
            .put(
                LEGACY_API_TLS_KEY,
                serde_json::to_vec(&value).unwrap(),
                Precondition::Absent,
            )
            .await
            .unwrap();
    }

    fn fingerprint_in(dir: &Path) -> String {
        crate::cli::server_trust::cert_file_fingerprint(&api_tls::self_signed_cert_path(dir))
            .unwrap()
    }

    #[tokio::test]
    async fn an_upgraded_control_plane_keeps_the_shared_certificate_and_deletes_its_key() {
        let store = MemoryStore::new();
        let listen = "127.0.0.1:0".parse().unwrap();
        // What an earlier version left: cp1's certificate, shared.
        let (old, fresh) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        api_tls::ensure_self_signed(old.path(), listen).unwrap();
        publish_as_before(&store, old.path()).await;

        assert!(withdraw_published_key(&store, fresh.path()).await.unwrap());
        assert_eq!(fingerprint_in(fresh.path()), fingerprint_in(old.path()));
        assert!(store.get(LEGACY_API_TLS_KEY).await.unwrap().is_none());
        // Nothing left to withdraw: a control plane's own certificate stays.
        assert!(!withdraw_published_key(&store, fresh.path()).await.unwrap());
        assert_eq!(fingerprint_in(fresh.path()), fingerprint_in(old.path()));
    }

    #[tokio::test]
    async fn a_control_plane_with_its_own_certificate_keeps_it() {
        let store = MemoryStore::new();
        let listen = "127.0.0.1:0".parse().unwrap();
        let (other, mine) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        api_tls::ensure_self_signed(other.path(), listen).unwrap();
        api_tls::ensure_self_signed(mine.path(), listen).unwrap();
        publish_as_before(&store, other.path()).await;
        let before = fingerprint_in(mine.path());
        assert!(withdraw_published_key(&store, mine.path()).await.unwrap());
        assert_eq!(fingerprint_in(mine.path()), before);
        assert!(store.get(LEGACY_API_TLS_KEY).await.unwrap().is_none());
    }
}
