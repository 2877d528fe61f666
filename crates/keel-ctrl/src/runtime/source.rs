//! Where the runtime's events come from: one watch per watched prefix,
//! opened after listing it (so nothing between list and watch is missed),
//! and the hypervisor's domain events (exits, QMP events). A watch that
//! breaks ends all of them; after `retry_ms` everything is listed again,
//! as changes made meanwhile were never delivered.

use std::sync::Arc;

use keel_api::Millis;
use keel_hv::DomainEvent;
use keel_store::{Store, StoreError, Watch, WatchEvent};
use tokio::sync::broadcast::{self, error::RecvError, error::TryRecvError};

use super::event::Event;
use crate::keys::{MIGRATIONS_PREFIX, NODES_PREFIX, SNAPSHOTS_PREFIX, VMS_PREFIX};
use crate::vm_index::ClusterReflector;

/// The prefixes watched: changes of the first three wake reconciles; node
/// records are watched for the [`ClusterReflector`] (a node's own drain,
/// its neighbours for targets), and wake no reconcile by themselves.
pub const WATCHED_PREFIXES: [&str; 4] = [
    VMS_PREFIX,
    SNAPSHOTS_PREFIX,
    MIGRATIONS_PREFIX,
    NODES_PREFIX,
];

/// What arrived: an event, or news that the watches ended.
#[derive(Debug)]
pub enum Incoming {
    Event(Event),
    /// A VM's change taken into the index that concerns no VM this node
    /// acts on (the per-node view, [`ClusterReflector::apply`]): it wakes
    /// nothing.
    Elsewhere,
    /// A watch failed or ended; the watches are closed until the relist.
    Broken(Option<StoreError>),
}

pub struct EventSource {
    store: Arc<dyn Store>,
    /// Open watches, in [`WATCHED_PREFIXES`] order; `None` while broken.
    watches: Option<[Watch; 4]>,
    /// When to list again while broken.
    relist_at: Millis,
    retry_ms: Millis,
    domain_events: Option<broadcast::Receiver<DomainEvent>>,
    /// Kept current with the VM records listed and watched here.
    vms: Option<Arc<ClusterReflector>>,
}

impl EventSource {
    /// Lists on first use (`relist_at` 0 is due at once).
    pub fn new(
        store: Arc<dyn Store>,
        domain_events: Option<broadcast::Receiver<DomainEvent>>,
        retry_ms: Millis,
    ) -> Self {
        Self {
            store,
            watches: None,
            relist_at: 0,
            retry_ms,
            domain_events,
            vms: None,
        }
    }

    /// Keeps `vms` current with every VM record this source lists and
    /// every change it takes in, before the change is handed on: a
    /// reconcile woken by a change finds it in the index.
    pub fn reflect(&mut self, vms: Arc<ClusterReflector>) {
        self.vms = Some(vms);
    }

    /// When the watches are due to be opened again, while they are closed.
    pub fn relist_at(&self) -> Option<Millis> {
        self.watches.is_none().then_some(self.relist_at)
    }

    pub fn is_open(&self) -> bool {
        self.watches.is_some()
    }

    /// Lists every watched prefix and opens its watch from just after the
    /// list; every record found as an event. On failure nothing is open
    /// and the next try is `retry_ms` after `now`.
    pub async fn relist(&mut self, now: Millis) -> Result<Vec<Event>, StoreError> {
        self.broke(now);
        let mut events = Vec::new();
        let mut opened = Vec::with_capacity(WATCHED_PREFIXES.len());
        let mut vm_records = Vec::new();
        let mut node_records = Vec::new();
        for prefix in WATCHED_PREFIXES {
            let (entries, revision) = self.store.list(prefix).await?;
            opened.push(self.store.watch(prefix, revision + 1).await?);
            events.extend(entries.iter().map(|e| Event::Listed { key: e.key.clone() }));
            match prefix {
                VMS_PREFIX => vm_records = entries,
                NODES_PREFIX => node_records = entries,
                _ => {}
            }
        }
        self.watches = opened.try_into().ok();
        // Only now that its watch is open and stays so: an index without
        // a watch behind it would silently fall behind.
        if let Some(vms) = &self.vms {
            vms.reset(&vm_records, &node_records);
            events.retain(|event| event.key().is_none_or(|key| vms.listed_concerns(key)));
        }
        Ok(events)
    }

    /// The watches failed: closed until the relist, `retry_ms` from `now`.
    pub fn broke(&mut self, now: Millis) {
        self.watches = None;
        self.relist_at = now + self.retry_ms;
        if let Some(vms) = &self.vms {
            vms.lost();
        }
    }

    /// The next thing that has already arrived, without waiting: domain
    /// events first, then each watch in [`WATCHED_PREFIXES`] order. This is how a
    /// simulation takes events in one defined order.
    pub fn try_next(&mut self) -> Option<Incoming> {
        if let Some(event) = self.try_domain_event() {
            return Some(Incoming::Event(Event::Domain(event)));
        }
        let watches = self.watches.as_mut()?;
        for (i, watch) in watches.iter_mut().enumerate() {
            if let Some(item) = watch.next_now() {
                let reflected = i == 0 || WATCHED_PREFIXES[i] == NODES_PREFIX;
                let vms = reflected.then_some(self.vms.as_deref()).flatten();
                return Some(incoming(item, vms));
            }
        }
        None
    }

    /// Waits for the next event or for the watches to break. With the
    /// watches closed, waits for domain events only.
    pub async fn next(&mut self) -> Incoming {
        let domain_events = &mut self.domain_events;
        let Some([vms, snapshots, migrations, nodes]) = self.watches.as_mut() else {
            return Incoming::Event(Event::Domain(next_domain_event(domain_events).await));
        };
        tokio::select! {
            event = next_domain_event(domain_events) => Incoming::Event(Event::Domain(event)),
            item = vms.next() => incoming(item, self.vms.as_deref()),
            item = snapshots.next() => incoming(item, None),
            item = migrations.next() => incoming(item, None),
            item = nodes.next() => incoming(item, self.vms.as_deref()),
        }
    }

    fn try_domain_event(&mut self) -> Option<DomainEvent> {
        let rx = self.domain_events.as_mut()?;
        loop {
            match rx.try_recv() {
                Ok(event) => return Some(event),
                // Missed some: the scheduled re-checks still find them.
                Err(TryRecvError::Lagged(_)) => continue,
                Err(TryRecvError::Empty) => return None,
                Err(TryRecvError::Closed) => {
                    self.domain_events = None;
                    return None;
                }
            }
        }
    }
}

/// `item` as the runtime takes it, once `reflector` (of the watch it came
/// from) has taken it in.
fn incoming(
    item: Option<Result<WatchEvent, StoreError>>,
    reflector: Option<&ClusterReflector>,
) -> Incoming {
    match item {
        Some(Ok(event)) => {
            if let Some(vms) = reflector {
                if !vms.apply(&event) {
                    return Incoming::Elsewhere;
                }
            }
            Incoming::Event(Event::Changed {
                key: event.key().to_string(),
            })
        }
        Some(Err(err)) => Incoming::Broken(Some(err)),
        None => Incoming::Broken(None),
    }
}

/// The next domain event; never resolves without a channel.
async fn next_domain_event(
    domain_events: &mut Option<broadcast::Receiver<DomainEvent>>,
) -> DomainEvent {
    let Some(rx) = domain_events else {
        return std::future::pending().await;
    };
    loop {
        match rx.recv().await {
            Ok(event) => return event,
            // Missed some: the scheduled re-checks still find what they
            // announced.
            Err(RecvError::Lagged(_)) => continue,
            Err(RecvError::Closed) => {
                *domain_events = None;
                return std::future::pending().await;
            }
        }
    }
}
