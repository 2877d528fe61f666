//! The API tokens every control plane (and every agent serving consoles)
//! accepts: records under `/tokens/<id>` holding the SHA-256 of each
//! secret, never the secret, kept in memory by a reflector fed by the
//! store's watch, so a token created or revoked through any control plane
//! counts everywhere as soon as the watch delivers it (milliseconds).
//!
//! A token is `keel_<id>_<secret>`: the id finds the record, the SHA-256 of
//! the secret is compared with the record's hash in constant time. The
//! secret is 256 bits from the OS: guessing it is hopeless whatever the
//! hash costs, so a slow password hash (argon2) would only slow every
//! request down and add nothing.
//!
//! A token file (`DATA_DIR/token`, the one token of earlier versions)
//! holds a bare secret; its record's id is derived from the secret's hash
//! (`file-<first 16 hex digits>`), so an old data dir keeps working and
//! its token is an admin token like any other: listed, revocable.
//!
//! When the watch breaks, the reflector lists again (with a short pause
//! between attempts); meanwhile every request reads its token's record
//! from the store itself, so a revocation is never missed. If the store
//! cannot be read either, requests are refused (503): fail closed.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use keel_api::{ApiToken, Clock, Millis, Role};
use keel_ctrl::keys::{token_key, API_TOKEN_KEY, TOKENS_PREFIX};
use keel_store::{StoreError, TypedStore, WatchEvent};
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::auth::{self, Token};

/// The start of every token minted by `POST /api/v1/tokens`.
pub const TOKEN_PREFIX: &str = "keel_";
/// The id of a token file's record starts with this.
pub const FILE_ID_PREFIX: &str = "file-";
/// Pause between attempts to list and watch again after the watch broke.
const RELIST_PAUSE: Duration = Duration::from_millis(250);

/// Hex SHA-256 of a secret.
pub fn hash_secret(secret: &str) -> String {
    hex(&Sha256::digest(secret.as_bytes()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The record id of a token file's bare secret.
pub fn file_token_id(secret: &str) -> String {
    format!("{FILE_ID_PREFIX}{}", &hash_secret(secret)[..16])
}

/// The record id a presented token names, and the secret to hash.
fn locate(presented: &str) -> (String, &str) {
    if let Some(rest) = presented.strip_prefix(TOKEN_PREFIX) {
        if let Some((id, secret)) = rest.split_once('_') {
            return (id.to_string(), secret);
        }
    }
    (file_token_id(presented), presented)
}

/// A token just made: its record and the one copy of its secret.
pub struct MintedToken {
    pub record: ApiToken,
    /// `keel_<id>_<secret>`: shown once, never stored.
    pub token: String,
}

/// A new token for `name` with `role`, created `now`.
pub fn mint(name: &str, role: Role, now: Millis, expires: Option<Millis>) -> MintedToken {
    let mut id = [0u8; 8];
    rand::rngs::OsRng.fill_bytes(&mut id);
    let id = hex(&id);
    let secret = auth::generate_secret();
    MintedToken {
        record: ApiToken {
            id: id.clone(),
            name: name.to_string(),
            role,
            created: now,
            expires,
            hash: hash_secret(&secret),
            revoked: None,
        },
        token: format!("{TOKEN_PREFIX}{id}_{secret}"),
    }
}

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub id: String,
    pub name: String,
    pub role: Role,
}

/// Why a presented token is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No token, or none with that id and secret.
    Unknown,
    /// Known, but revoked or expired: the reason.
    Refused(&'static str),
    /// The records could not be read: refused rather than guessed.
    Unavailable(String),
}

/// The token records, as the store's watch last told them.
pub struct TokenBook {
    store: TypedStore,
    clock: Arc<dyn Clock>,
    records: RwLock<HashMap<String, ApiToken>>,
    /// The watch is running and `records` follows the store.
    watching: AtomicBool,
}

impl TokenBook {
    /// A book that reads through to the store until
    /// [`TokenBook::spawn_reflector`]'s first listing.
    pub fn new(store: TypedStore, clock: Arc<dyn Clock>) -> Arc<Self> {
        Arc::new(Self {
            store,
            clock,
            records: RwLock::default(),
            watching: AtomicBool::new(false),
        })
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Whether the reflector's watch is running now.
    pub fn is_watching(&self) -> bool {
        self.watching.load(Ordering::SeqCst)
    }

    /// The caller `presented` (the bearer token) stands for.
    pub async fn authenticate(&self, presented: &str) -> Result<Caller, Refusal> {
        if presented.is_empty() {
            return Err(Refusal::Unknown);
        }
        let (id, secret) = locate(presented);
        let cached = if self.is_watching() {
            self.records
                .read()
                .expect("token records")
                .get(&id)
                .cloned()
        } else {
            None
        };
        let record = match cached {
            Some(record) => record,
            // Not watching, or a token made elsewhere a moment ago that the
            // watch has not delivered yet: the store says.
            None => match self.store.get::<ApiToken>(&token_key(&id)).await {
                Ok(Some(entry)) => entry.value,
                Ok(None) => return Err(Refusal::Unknown),
                Err(StoreError::Corrupt { .. }) => return Err(Refusal::Unknown),
                Err(err) => return Err(Refusal::Unavailable(err.to_string())),
            },
        };
        let presented_hash = hash_secret(secret);
        if !bool::from(presented_hash.as_bytes().ct_eq(record.hash.as_bytes())) {
            return Err(Refusal::Unknown);
        }
        if let Some(reason) = record.refusal(self.clock.now_ms()) {
            return Err(Refusal::Refused(reason));
        }
        Ok(Caller {
            id: record.id,
            name: record.name,
            role: record.role,
        })
    }

    /// Takes in a record this process just wrote, so that it counts here
    /// at once, before the watch brings it.
    pub fn remember(&self, record: ApiToken) {
        self.records
            .write()
            .expect("token records")
            .insert(record.id.clone(), record);
    }

    /// Every token record, from the store.
    pub async fn list(&self) -> Result<Vec<ApiToken>, StoreError> {
        let (entries, _) = self.store.list::<ApiToken>(TOKENS_PREFIX).await?;
        Ok(entries.into_iter().map(|(_, e)| e.value).collect())
    }

    /// Keeps `records` in step with the store until `shutdown`.
    pub fn spawn_reflector(
        self: &Arc<Self>,
        mut shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        let book = self.clone();
        tokio::spawn(async move {
            loop {
                if *shutdown.borrow() {
                    return;
                }
                if let Err(err) = book.follow(&mut shutdown).await {
                    tracing::warn!(%err, "token watch broke; requests read the store until it is back");
                }
                book.watching.store(false, Ordering::SeqCst);
                tokio::select! {
                    () = tokio::time::sleep(RELIST_PAUSE) => {}
                    _ = shutdown.changed() => {}
                }
            }
        })
    }

    /// One listing and the watch from it, until the watch ends.
    async fn follow(&self, shutdown: &mut watch::Receiver<bool>) -> Result<(), StoreError> {
        let raw = self.store.raw();
        let (entries, revision) = raw.list(TOKENS_PREFIX).await?;
        let mut watch = raw.watch(TOKENS_PREFIX, revision + 1).await?;
        let listed: HashMap<String, ApiToken> = entries
            .iter()
            .filter_map(|e| serde_json::from_slice::<ApiToken>(&e.value).ok())
            .map(|t| (t.id.clone(), t))
            .collect();
        *self.records.write().expect("token records") = listed;
        self.watching.store(true, Ordering::SeqCst);
        loop {
            tokio::select! {
                event = watch.next() => match event {
                    Some(Ok(WatchEvent::Put(entry))) => {
                        match serde_json::from_slice::<ApiToken>(&entry.value) {
                            Ok(record) => self.remember(record),
                            // Read from the store on use instead (and refused).
                            Err(_) => self.forget(&entry.key),
                        }
                    }
                    Some(Ok(WatchEvent::Deleted { key, .. })) => self.forget(&key),
                    Some(Err(err)) => return Err(err),
                    None => return Ok(()),
                },
                _ = shutdown.changed() => {
                    if *shutdown.borrow() {
                        return Ok(());
                    }
                }
            }
        }
    }

    fn forget(&self, key: &str) {
        if let Some(id) = key.strip_prefix(TOKENS_PREFIX) {
            self.records.write().expect("token records").remove(id);
        }
    }

    /// Makes the token file's secret an admin token named `name`, unless
    /// its record exists (a revoked one stays revoked). A different
    /// earlier token of the same name (the file was rotated) is revoked:
    /// rotating the file retires the old secret.
    pub async fn adopt_file_token(&self, secret: &str, name: &str) -> anyhow::Result<()> {
        let id = file_token_id(secret);
        let key = token_key(&id);
        let now = self.clock.now_ms();
        if self.store.get::<ApiToken>(&key).await?.is_none() {
            let record = ApiToken {
                id: id.clone(),
                name: name.to_string(),
                role: Role::Admin,
                created: now,
                expires: None,
                hash: hash_secret(secret),
                revoked: None,
            };
            match self.store.create(&key, &record).await {
                Ok(_) => {
                    tracing::info!(token = %name, %id, "the token file's token is an admin token")
                }
                Err(StoreError::Conflict { .. }) => {}
                Err(err) => return Err(err.into()),
            }
        }
        let (entries, _) = self.store.list::<ApiToken>(TOKENS_PREFIX).await?;
        for (key, entry) in entries {
            let old = entry.value;
            if old.id == id || old.name != name || !old.id.starts_with(FILE_ID_PREFIX) {
                continue;
            }
            if old.revoked.is_some() {
                continue;
            }
            let revoked = ApiToken {
                revoked: Some(now),
                ..old
            };
            match self.store.update(&key, &revoked, entry.revision).await {
                Ok(_) => {
                    tracing::info!(token = %name, id = %revoked.id, "revoked the token file's former token")
                }
                Err(StoreError::Conflict { .. }) => {}
                Err(err) => return Err(err.into()),
            }
        }
        Ok(())
    }
}

/// The name of the token file's record on `node`.
pub fn file_token_name(node: &str) -> String {
    format!("token-file-{node}")
}

/// Start-up of a control plane: the token of its token file (generated on
/// first start) becomes an admin token record. A store written by an
/// earlier version holds the cluster's one token in clear at
/// `/config/api-token`: that token is taken over (into the token file, as
/// those versions did, so the CLI here keeps working), recorded hashed,
/// and the clear copy deleted, so no reader of the store learns it.
pub async fn bootstrap(book: &TokenBook, token_file: &Path, node: &str) -> anyhow::Result<Token> {
    let raw = book.store.raw().clone();
    let clear = raw.get(API_TOKEN_KEY).await?;
    let token = match &clear {
        Some(entry) => {
            let secret = String::from_utf8(entry.value.clone())
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .with_context(|| format!("the store's {API_TOKEN_KEY} is empty or not UTF-8"))?;
            let token = Token::new(secret);
            auth::write_local(token_file, &token)?;
            token
        }
        None => auth::load_or_create_at(token_file)?,
    };
    book.adopt_file_token(token.secret(), &file_token_name(node))
        .await?;
    if let Some(entry) = clear {
        // Recorded hashed above before the clear copy goes.
        match raw.delete(API_TOKEN_KEY, entry.mod_revision).await {
            Ok(_) => tracing::info!(
                key = API_TOKEN_KEY,
                "moved the cluster's clear API token to a hashed token record"
            ),
            Err(StoreError::Conflict { .. }) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::ManualClock;
    use keel_store::memory::MemoryStore;

    fn book() -> (Arc<TokenBook>, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000));
        let store = TypedStore::new(Arc::new(MemoryStore::new()));
        (TokenBook::new(store, clock.clone()), clock)
    }

    #[tokio::test]
    async fn minted_tokens_authenticate_until_revoked_or_expired() {
        let (book, clock) = book();
        let minted = mint("ci", Role::Operator, 1_000, Some(5_000));
        assert!(minted.token.starts_with("keel_"));
        assert!(!minted.token.contains(&minted.record.hash));
        let key = token_key(&minted.record.id);
        book.store.create(&key, &minted.record).await.unwrap();
        let caller = book.authenticate(&minted.token).await.unwrap();
        assert_eq!((caller.name.as_str(), caller.role), ("ci", Role::Operator));
        // One character off, anywhere: unknown.
        let mut wrong = minted.token.clone();
        let last = wrong.pop().unwrap();
        wrong.push(if last == '0' { '1' } else { '0' });
        assert_eq!(book.authenticate(&wrong).await, Err(Refusal::Unknown));
        assert_eq!(book.authenticate("").await, Err(Refusal::Unknown));
        assert_eq!(
            book.authenticate("keel_nope_x").await,
            Err(Refusal::Unknown)
        );
        clock.advance(4_000);
        assert_eq!(
            book.authenticate(&minted.token).await,
            Err(Refusal::Refused("token expired"))
        );
    }

    #[tokio::test]
    async fn the_reflector_follows_revocations_and_the_book_reads_through_meanwhile() {
        let (book, _) = book();
        let minted = mint("ops", Role::Admin, 1_000, None);
        let key = token_key(&minted.record.id);
        let rev = book.store.create(&key, &minted.record).await.unwrap();
        // Not watching yet: read from the store.
        assert!(book.authenticate(&minted.token).await.is_ok());
        let (_stop, stop_rx) = watch::channel(false);
        let reflector = book.spawn_reflector(stop_rx);
        for _ in 0..200 {
            if book.is_watching() {
                break;
            }
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(book.is_watching());
        let revoked = ApiToken {
            revoked: Some(2_000),
            ..minted.record.clone()
        };
        book.store.update(&key, &revoked, rev).await.unwrap();
        let mut refused = None;
        for _ in 0..200 {
            match book.authenticate(&minted.token).await {
                Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                Err(r) => {
                    refused = Some(r);
                    break;
                }
            }
        }
        assert_eq!(refused, Some(Refusal::Refused("token revoked")));
        reflector.abort();
    }

    #[tokio::test]
    async fn a_token_file_is_an_admin_token_and_rotating_it_retires_the_old_one() {
        let (book, _) = book();
        let dir = tempfile::tempdir().unwrap();
        let path = auth::token_path(dir.path());
        let first = bootstrap(&book, &path, "n1").await.unwrap();
        let caller = book.authenticate(first.secret()).await.unwrap();
        assert_eq!(caller.role, Role::Admin);
        assert_eq!(caller.name, "token-file-n1");
        // Again: the same record, still working.
        assert_eq!(
            bootstrap(&book, &path, "n1").await.unwrap().secret(),
            first.secret()
        );
        assert_eq!(book.list().await.unwrap().len(), 1);
        // Rotated: the new one works, the old one is revoked.
        let rotated = Token::new(auth::generate_secret());
        auth::write_local(&path, &rotated).unwrap();
        bootstrap(&book, &path, "n1").await.unwrap();
        assert!(book.authenticate(rotated.secret()).await.is_ok());
        assert_eq!(
            book.authenticate(first.secret()).await,
            Err(Refusal::Refused("token revoked"))
        );
    }

    #[tokio::test]
    async fn the_clear_token_of_an_older_version_becomes_a_hashed_record() {
        let (book, _) = book();
        let old = auth::generate_secret();
        book.store
            .raw()
            .put(
                API_TOKEN_KEY,
                old.clone().into_bytes(),
                keel_store::Precondition::Absent,
            )
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = auth::token_path(dir.path());
        let token = bootstrap(&book, &path, "cp1").await.unwrap();
        assert_eq!(token.secret(), old, "the cluster's token keeps working");
        assert_eq!(auth::read_token_file(&path).unwrap(), old);
        assert!(book.store.raw().get(API_TOKEN_KEY).await.unwrap().is_none());
        let (all, _) = book.store.raw().list("/").await.unwrap();
        for entry in all {
            let text = String::from_utf8_lossy(&entry.value);
            assert!(!text.contains(&old), "{} holds the secret", entry.key);
        }
        assert_eq!(book.authenticate(&old).await.unwrap().role, Role::Admin);
    }
}
