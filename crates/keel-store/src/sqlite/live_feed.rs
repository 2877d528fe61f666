//! The live feed of committed changes to the store's watches, one
//! broadcast per first path segment of the key (`/vms/`, `/nodes/`, ...).
//!
//! One broadcast for every change woke every watch for every change, each
//! only to find most were not under its prefix: fifty nodes in one process
//! watch four prefixes each, so a VM's change woke two hundred watches for
//! the fifty it was for, and a phase event (`/events/`, watched by nobody)
//! woke them all. A watch whose prefix holds a whole first segment now
//! wakes only for changes under that segment; any other prefix (`""`,
//! `/v`) still hears every change.
//!
//! A message is one revision's changes (an atomic write's keys travel
//! together); a segment's feed gets those of its segment.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::broadcast;

use crate::WatchEvent;

pub(super) type Feed = broadcast::Receiver<Arc<[WatchEvent]>>;

pub(super) struct LiveFeed {
    /// Changes buffered per watch before it falls back to history.
    capacity: usize,
    by_segment: HashMap<String, broadcast::Sender<Arc<[WatchEvent]>>>,
    /// For prefixes that name no whole segment: every change.
    every: broadcast::Sender<Arc<[WatchEvent]>>,
}

impl LiveFeed {
    pub(super) fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            capacity,
            by_segment: HashMap::new(),
            every: broadcast::channel(capacity).0,
        }
    }

    /// A feed with at least every change under `prefix`, from now on.
    pub(super) fn subscribe(&mut self, prefix: &str) -> Feed {
        match first_segment(prefix) {
            Some(segment) => {
                let capacity = self.capacity;
                self.by_segment
                    .entry(segment.to_string())
                    .or_insert_with(|| broadcast::channel(capacity).0)
                    .subscribe()
            }
            None => self.every.subscribe(),
        }
    }

    /// Sends the changes of one revision.
    pub(super) fn send(&self, revision: &[WatchEvent]) {
        for (segment, bus) in &self.by_segment {
            if bus.receiver_count() == 0 {
                continue;
            }
            let under: Vec<WatchEvent> = revision
                .iter()
                .filter(|e| first_segment(e.key()) == Some(segment.as_str()))
                .cloned()
                .collect();
            if !under.is_empty() {
                let _ = bus.send(under.into());
            }
        }
        if self.every.receiver_count() > 0 {
            let _ = self.every.send(revision.into());
        }
    }
}

/// `/vms/` of `/vms/a` and of `/vms/`; none of `/vms`, `vms/a` or `""`,
/// whose changes may lie under several segments.
fn first_segment(path: &str) -> Option<&str> {
    let rest = path.strip_prefix('/')?;
    let end = rest.find('/')?;
    Some(&path[..end + 2])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Entry;

    fn put(key: &str, revision: u64) -> WatchEvent {
        WatchEvent::Put(Entry {
            key: key.into(),
            value: vec![],
            create_revision: revision,
            mod_revision: revision,
        })
    }

    #[test]
    fn a_watch_hears_its_segment_and_a_watch_of_no_segment_hears_all() {
        assert_eq!(first_segment("/vms/a"), Some("/vms/"));
        assert_eq!(first_segment("/vms/"), Some("/vms/"));
        assert_eq!(first_segment("/vms"), None);
        assert_eq!(first_segment(""), None);
        assert_eq!(first_segment("vms/a"), None);

        let mut feed = LiveFeed::new(16);
        let mut vms = feed.subscribe("/vms/");
        let mut one_vm = feed.subscribe("/vms/a");
        let mut all = feed.subscribe("");
        let mut vm_ish = feed.subscribe("/vm");
        feed.send(&[put("/events/a/1", 1)]);
        feed.send(&[put("/vms/a", 2)]);
        feed.send(&[put("/nodes/n1", 3)]);
        // One atomic write: each feed gets its own keys of it, together.
        feed.send(&[put("/vms/b", 4), put("/events/b/1", 4), put("/vms/c", 4)]);
        let heard = |feed: &mut Feed| {
            let mut messages = Vec::new();
            while let Ok(group) = feed.try_recv() {
                messages.push(
                    group
                        .iter()
                        .map(|e| e.key().to_string())
                        .collect::<Vec<_>>(),
                );
            }
            messages
        };
        assert_eq!(heard(&mut vms), [vec!["/vms/a"], vec!["/vms/b", "/vms/c"]]);
        assert_eq!(heard(&mut one_vm).len(), 2);
        assert_eq!(
            heard(&mut all),
            [
                vec!["/events/a/1"],
                vec!["/vms/a"],
                vec!["/nodes/n1"],
                vec!["/vms/b", "/events/b/1", "/vms/c"]
            ]
        );
        assert_eq!(heard(&mut vm_ish).len(), 4);
    }
}
