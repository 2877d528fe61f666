//! `keel serve` on etcd: its turns with the other control planes at
//! compacting etcd's history (`keel_store::etcd::compaction`), once every
//! `--etcd-compaction-interval`. Without them etcd's database grows until
//! it reaches its quota and refuses every write, heartbeats included.

use std::time::Duration;

use keel_store::etcd::compaction::{HistoryCompactor, Round};
use keel_store::etcd::EtcdStore;
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;

/// As kube-apiserver's `--etcd-compaction-interval`: a watch that broke
/// resumes without a re-list if it is back within this long.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5 * 60);

/// Takes a turn once every `every` (the first at once, which only notes
/// where history stands) until `stop` turns true.
pub async fn compact_every(store: EtcdStore, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut compactor = HistoryCompactor::new(store);
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            changed = stop.changed() => if changed.is_err() || *stop.borrow() {
                return;
            },
        }
        match compactor.round().await {
            Ok(Round::Compacted { before }) => {
                tracing::info!(
                    before,
                    "etcd history compacted: revisions before this one discarded"
                )
            }
            Ok(Round::Noted { at }) => {
                tracing::debug!(
                    at,
                    "etcd history: compaction turn taken, up to here next time"
                )
            }
            Ok(Round::TakenElsewhere { at }) => {
                tracing::debug!(
                    at,
                    "etcd history: another control plane took this compaction turn"
                )
            }
            Err(err) => tracing::warn!(
                err = %keel_ctrl::error_chain(&err),
                "cannot compact etcd's history; trying again at the next interval"
            ),
        }
    }
}
