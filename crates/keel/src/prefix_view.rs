//! What every watch-fed view of a key prefix does to stay current (the
//! metrics' phase tallies and record facts, the `--max-vms` count): list
//! the prefix, follow the watch from just after the list, and list again
//! whenever the watch breaks or ends, until told to stop.

use std::time::Duration;

use keel_store::{Entry, Store, StoreError, WatchEvent};
use tokio::sync::watch;

/// The pause before listing again after a broken watch.
const RETRY: Duration = Duration::from_secs(1);

/// A view kept by [`keep`].
pub trait PrefixView: Send + Sync {
    /// Everything under the prefix, as listed: replaces what it held.
    fn reset(&self, entries: &[Entry]);
    /// One change after the list.
    fn apply(&self, event: &WatchEvent);
    /// The watch broke or ended: what is held may miss changes until the
    /// next list (a view that must not be read stale forgets it here).
    fn broke(&self) {}
}

/// Keeps `view` current with `prefix` of `store` until `stop` turns true.
pub async fn keep(
    view: &dyn PrefixView,
    store: &dyn Store,
    prefix: &str,
    mut stop: watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        if let Err(err) = follow(view, store, prefix, &mut stop).await {
            tracing::debug!(prefix, %err, "watch-fed view: relisting");
        }
        view.broke();
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = stop.changed() => {}
        }
    }
}

async fn follow(
    view: &dyn PrefixView,
    store: &dyn Store,
    prefix: &str,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), StoreError> {
    let (entries, revision) = store.list(prefix).await?;
    let mut watch = store.watch(prefix, revision + 1).await?;
    view.reset(&entries);
    drop(entries);
    loop {
        tokio::select! {
            event = watch.next() => match event {
                Some(Ok(event)) => view.apply(&event),
                Some(Err(err)) => return Err(err),
                None => return Ok(()),
            },
            _ = stop.changed() => {
                if *stop.borrow() {
                    return Ok(());
                }
            }
        }
    }
}
