//! Leader election among control planes, on the store's leases.
//!
//! A candidate grants itself a lease and creates [`LEADER_KEY`] under it
//! (`Precondition::Absent`), naming itself. Whoever created the key leads
//! until the key is gone: the lease expired (the leader stopped renewing:
//! dead, paused, cut off), was revoked (it stepped down), or the key was
//! deleted. The others poll the key and try again once it is gone.
//!
//! Two rules keep a deposed leader from acting:
//!
//! * It counts itself leader only while its last successful keep-alive is
//!   younger than the TTL minus a safety margin, timed from *before* the
//!   keep-alive was sent, so on the injected [`Clock`] it stops before the
//!   store could have expired the lease.
//! * Every cluster-level write it makes is guarded by the `create_revision`
//!   of its leader key ([`LeaderElection::guard`]): the store rejects it
//!   with `GuardLost` once that key is gone, whatever the leader believes.
//!   The first rule keeps it from trying; the second is what makes it safe.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_api::{Clock, Millis, Mono};
use keel_store::{Guard, LeaseId, Precondition, Store, StoreError};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::keys::LEADER_KEY;

/// Election timings, in milliseconds.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    /// TTL of the leader's lease: how long a dead leader blocks the next
    /// one at most. Renewed every third of it. (etcd rounds it up to whole
    /// seconds, at least 2 s; a longer lease only delays a takeover.)
    pub ttl_ms: Millis,
    /// A leader stops acting this long before its lease could run out, for
    /// clock-rate differences and a keep-alive answer still in flight.
    pub safety_margin_ms: Millis,
    /// How often a follower looks at the leader key.
    pub retry_ms: Millis,
}

impl Default for ElectionConfig {
    fn default() -> Self {
        Self {
            ttl_ms: 6_000,
            safety_margin_ms: 1_500,
            retry_ms: 1_000,
        }
    }
}

impl ElectionConfig {
    /// How often the leader renews its lease.
    pub fn renew_every_ms(&self) -> Millis {
        (self.ttl_ms / 3).max(1)
    }

    /// How long after a keep-alive was sent the leader may act on it.
    pub fn valid_for_ms(&self) -> Millis {
        self.ttl_ms.saturating_sub(self.safety_margin_ms)
    }
}

/// The value of the leader key: who leads, since when (its process start).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderRecord {
    pub id: String,
    pub started_at: Millis,
}

/// One period of leadership: the lease, the leader key's incarnation, and
/// when the last successful renewal was sent.
#[derive(Debug, Clone)]
struct Term {
    lease: LeaseId,
    guard: Guard,
    /// Monotonic: a wall clock stepped forward must not end a term early,
    /// nor one stepped back keep it past the store's lease.
    renewed_at: Mono,
}

pub struct LeaderElection {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    cfg: ElectionConfig,
    me: LeaderRecord,
    term: Mutex<Option<Term>>,
    /// Leadership as of the last step, for whoever waits on it.
    leading: watch::Sender<bool>,
}

impl LeaderElection {
    /// A candidate named `id` (unique among the control planes: it is what
    /// the leader key says), not campaigning yet.
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        id: impl Into<String>,
        cfg: ElectionConfig,
    ) -> Self {
        let me = LeaderRecord {
            id: id.into(),
            started_at: clock.now_ms(),
        };
        let (leading, _) = watch::channel(false);
        Self {
            store,
            clock,
            cfg,
            me,
            term: Mutex::new(None),
            leading,
        }
    }

    pub fn id(&self) -> &str {
        &self.me.id
    }

    pub fn config(&self) -> &ElectionConfig {
        &self.cfg
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Term>> {
        self.term.lock().expect("election state poisoned")
    }

    /// The guard for this leader's writes, while it may act as leader:
    /// `None` once its last renewal is older than the TTL minus the margin.
    pub fn guard(&self) -> Option<Guard> {
        let now = self.clock.mono();
        let term = self.lock();
        term.as_ref()
            .filter(|t| now < t.renewed_at.plus(self.cfg.valid_for_ms()))
            .map(|t| t.guard.clone())
    }

    pub fn is_leader(&self) -> bool {
        self.guard().is_some()
    }

    /// Changes to [`LeaderElection::is_leader`] as seen by `step`.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leading.subscribe()
    }

    /// Who leads now, as the store says.
    pub async fn leader(&self) -> Result<Option<LeaderRecord>, StoreError> {
        Ok(self
            .store
            .get(LEADER_KEY)
            .await?
            .and_then(|e| serde_json::from_slice(&e.value).ok()))
    }

    /// A guarded write found the leader key gone: stop acting at once. The
    /// lease is left to expire (it holds nothing of ours any more).
    pub fn lost(&self, guard: &Guard) {
        let mut term = self.lock();
        if term.as_ref().is_some_and(|t| t.guard == *guard) {
            tracing::warn!(candidate = %self.me.id, "leader key lost; stepping down");
            *term = None;
            drop(term);
            self.leading.send_replace(false);
        }
    }

    /// One round of the campaign: a leader renews its lease (and checks its
    /// key is still its own); anyone else tries to create the leader key if
    /// it is absent. Returns whether this candidate leads afterwards. An
    /// error leaves a leader leading until its last renewal is too old.
    pub async fn step(&self) -> Result<bool, StoreError> {
        let result = self.step_inner().await;
        let leading = self.is_leader();
        self.leading
            .send_if_modified(|l| std::mem::replace(l, leading) != leading);
        result.map(|()| leading)
    }

    async fn step_inner(&self) -> Result<(), StoreError> {
        let current = self.lock().clone();
        let Some(term) = current else {
            return self.campaign().await;
        };
        let now = self.clock.mono();
        if now >= term.renewed_at.plus(self.cfg.valid_for_ms()) {
            // Could not renew in time: the store may already have expired
            // the lease, so this term is over whatever happens next.
            tracing::warn!(candidate = %self.me.id, "leadership expired: the lease was not renewed in time");
            self.end_term(&term);
            let _ = self.store.revoke_lease(term.lease).await;
            return self.campaign().await;
        }
        let sent_at = now;
        match self.store.keep_alive(term.lease).await {
            Ok(()) => {}
            Err(StoreError::LeaseNotFound { .. }) => {
                tracing::warn!(candidate = %self.me.id, "leader lease gone; stepping down");
                self.end_term(&term);
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        // The lease lives; is the key still the one it created?
        let entry = self.store.get(LEADER_KEY).await?;
        if !term.guard.holds(entry.as_ref()) {
            tracing::warn!(candidate = %self.me.id, "leader key deleted or replaced; stepping down");
            self.end_term(&term);
            let _ = self.store.revoke_lease(term.lease).await;
            return Ok(());
        }
        let mut current = self.lock();
        if let Some(t) = current.as_mut().filter(|t| t.guard == term.guard) {
            t.renewed_at = t.renewed_at.max(sent_at);
        }
        Ok(())
    }

    fn end_term(&self, term: &Term) {
        let mut current = self.lock();
        if current.as_ref().is_some_and(|t| t.guard == term.guard) {
            *current = None;
        }
    }

    async fn campaign(&self) -> Result<(), StoreError> {
        if self.store.get(LEADER_KEY).await?.is_some() {
            return Ok(());
        }
        // Timed from before the grant: the store's lease runs from later.
        let sent_at = self.clock.mono();
        let lease = self.store.grant_lease(self.cfg.ttl_ms).await?;
        let value = serde_json::to_vec(&self.me).expect("leader record serializes");
        match self
            .store
            .put_with_lease(LEADER_KEY, value, Precondition::Absent, lease)
            .await
        {
            Ok(revision) => {
                let guard = Guard {
                    key: LEADER_KEY.to_string(),
                    create_revision: revision,
                };
                tracing::info!(candidate = %self.me.id, term = revision, "became leader");
                *self.lock() = Some(Term {
                    lease,
                    guard,
                    renewed_at: sent_at,
                });
                Ok(())
            }
            Err(e) => {
                // Someone else was faster (Conflict), or the outcome is
                // unknown: revoking deletes the key if it was created.
                let _ = self.store.revoke_lease(lease).await;
                match e {
                    StoreError::Conflict { .. } => Ok(()),
                    e => Err(e),
                }
            }
        }
    }

    /// Steps down: revokes the lease, which deletes the leader key at once
    /// so another candidate can take over without waiting for the TTL.
    pub async fn resign(&self) {
        let term = self.lock().take();
        self.leading.send_replace(false);
        if let Some(term) = term {
            match self.store.revoke_lease(term.lease).await {
                Ok(()) => tracing::info!(candidate = %self.me.id, "resigned leadership"),
                Err(err) => {
                    tracing::warn!(candidate = %self.me.id, %err, "resigning: could not revoke the leader lease; it expires on its own")
                }
            }
        }
    }

    /// Campaigns until `stop` turns true, then resigns. Leaders renew every
    /// third of the TTL; followers look at the leader key every `retry_ms`.
    pub async fn run(&self, mut stop: watch::Receiver<bool>) {
        while !*stop.borrow() {
            let wait = match self.step().await {
                Ok(true) => self.cfg.renew_every_ms(),
                Ok(false) => self.cfg.retry_ms,
                Err(err) => {
                    tracing::warn!(candidate = %self.me.id, %err, "election step failed");
                    // A leader retries its renewal sooner than planned.
                    self.cfg.retry_ms.min(self.cfg.renew_every_ms())
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
                _ = stop.changed() => {}
            }
        }
        self.resign().await;
    }
}
