//! Discarding etcd's old history, so its database stays bounded: etcd
//! keeps every revision of every key until someone compacts, and a Keel
//! cluster rewrites records all day (heartbeats, VM status, events). Left
//! alone, the database grows until it reaches etcd's quota (2 GiB by
//! default); etcd then refuses every write, no agent can renew its lease,
//! and every node fences its guests.
//!
//! Kubernetes' API servers do this for their etcd, and Keel's control
//! planes do it the same way (kube-apiserver's `storage/etcd3/compact.go`):
//! every interval, each control plane tries to take the turn by a
//! compare-and-swap on the version of one key; the one that takes it
//! compacts up to the revision it saw when it took the *previous* turn.
//! So at most one control plane compacts per interval, without a leader,
//! and history is kept for at least one interval: a watch that broke (a
//! partition, a restarting agent) resumes without loss if it comes back
//! within it, and re-lists (on `Compacted`) if it comes back later.
//!
//! The turns are rounds of [`HistoryCompactor::round`]; the caller times
//! them (`keel serve`'s `--etcd-compaction-interval`).

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use super::{compact_failed, from_etcd, unavailable, EtcdStore};
use crate::{Revision, StoreError};

/// The key whose version counts the turns taken, under the store's
/// namespace; its value is the revision the last turn saw (for people
/// reading etcd, nothing reads it back).
pub const COMPACTION_KEY: &str = "/etcd-compaction";

/// What one round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// This process took the turn and discarded the history before
    /// `before` (the revision it saw at its previous turn).
    Compacted { before: Revision },
    /// This process took its first turn: it notes where history stands,
    /// and the next turn compacts up to there.
    Noted { at: Revision },
    /// Another process took this turn; this one notes where history
    /// stands, and compacts up to there if it takes the next turn.
    TakenElsewhere { at: Revision },
}

/// One process's turns at compacting etcd's history.
pub struct HistoryCompactor {
    store: EtcdStore,
    /// The compaction key's version this process expects: the turns taken
    /// so far, as it last saw them.
    turn: i64,
    /// The cluster revision at this process's last round: what its next
    /// turn compacts up to (0: nothing seen yet).
    seen: Revision,
}

impl HistoryCompactor {
    pub fn new(store: EtcdStore) -> Self {
        Self {
            store,
            turn: 0,
            seen: 0,
        }
    }

    /// Tries to take the next turn and, if taken, compacts up to the
    /// revision seen at the previous round.
    pub async fn round(&mut self) -> Result<Round, StoreError> {
        let key = self.store.etcd_key(COMPACTION_KEY);
        let txn = Txn::new()
            .when(vec![Compare::version(
                key.clone(),
                CompareOp::Equal,
                self.turn,
            )])
            .and_then(vec![TxnOp::put(key.clone(), self.seen.to_string(), None)])
            .or_else(vec![TxnOp::get(key, None)]);
        let mut kv = self.store.client.kv_client();
        let response = self
            .store
            .call(kv.txn(txn))
            .await
            .map_err(|f| unavailable(COMPACTION_KEY, &f, true))?;
        let now = from_etcd(response.header().map_or(0, |h| h.revision()));
        if !response.succeeded() {
            // Another process's turn: count it as taken, from the version
            // the key has now (0 if someone removed the key: start over).
            self.turn = response
                .op_responses()
                .into_iter()
                .find_map(|op| match op {
                    TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.version()),
                    _ => None,
                })
                .unwrap_or(0);
            self.seen = now;
            return Ok(Round::TakenElsewhere { at: now });
        }
        self.turn += 1;
        let before = std::mem::replace(&mut self.seen, now);
        if before == 0 {
            return Ok(Round::Noted { at: now });
        }
        match self.store.try_compact(before).await {
            Ok(()) => Ok(Round::Compacted { before }),
            // Compacted further already (etcd's own auto-compaction, or an
            // operator): what this turn was for is done.
            Err(f) if f.is_compacted() => Ok(Round::Compacted { before }),
            Err(f) => Err(compact_failed(before, &f)),
        }
    }
}
