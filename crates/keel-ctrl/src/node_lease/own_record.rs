//! This node's record as this agent last wrote it, so that a heartbeat
//! is one round trip to the store, not two.
//!
//! The heartbeat rewrites the node's record by compare-and-swap. Read
//! first each time, a heartbeat cost a read and a write, and over a slow
//! link (an etcd far away or overloaded) the two together could outlast
//! the heartbeat's bound when either alone would not. Writing on the
//! revision of its own last write is just as safe: if anybody else wrote
//! the record since (a freeze, a drain, labels, another incarnation of
//! the node), the write fails as a conflict, the record is read, and the
//! change is made on what is stored.

use std::sync::Mutex;

use keel_api::Node;
use keel_store::{Revision, TypedEntry};

#[derive(Debug, Default)]
pub struct OwnRecord {
    last: Mutex<Option<TypedEntry<Node>>>,
}

impl OwnRecord {
    /// The record as last written here, to write on; `None`: read it from
    /// the store.
    pub fn known(&self) -> Option<TypedEntry<Node>> {
        self.last.lock().expect("own record lock").clone()
    }

    /// The record is stored as `value` at `revision`.
    pub fn remember(&self, value: Node, revision: Revision) {
        *self.last.lock().expect("own record lock") = Some(TypedEntry { value, revision });
    }

    /// What is stored is not known (someone else wrote it): read it next.
    pub fn forget(&self) {
        *self.last.lock().expect("own record lock") = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_the_last_write_until_forgotten() {
        let own = OwnRecord::default();
        assert!(own.known().is_none());
        own.remember(Node::new("n1"), 7);
        let known = own.known().expect("remembered");
        assert_eq!((known.value.name.as_str(), known.revision), ("n1", 7));
        own.forget();
        assert!(own.known().is_none());
    }
}
