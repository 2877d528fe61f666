//! The VM records a node's agent keeps undecoded until it needs them.
//!
//! Every agent receives every VM's every write, and decoding each into its
//! index was much of what an agent did (10 agents on etcd decoded 10,000
//! VMs' every write ten times over), although an agent acts only on the
//! records that concern its node ([`crate::node_concern`]). A record
//! concerns a node only through a field that names it (its instance's or
//! placement's node, an incoming migration's target), and records are
//! JSON, where a node's name is written as itself between quotes. So a
//! record whose bytes do not contain `"<node>"` cannot concern the node,
//! and is kept as written, to be decoded only when a question about the
//! whole cluster is asked (where a VM leaving a draining node could go);
//! by then most have been superseded and are decoded once, not once per
//! write. A record that names the node elsewhere (its disks' home, a
//! hostname) is decoded as before: a decode too many, never one too few.

use std::collections::HashMap;

use keel_store::Revision;
use memchr::memmem::Finder;

/// The undecoded records of one node's index.
#[derive(Debug, Clone)]
pub struct DeferredRecords {
    /// Finds the node's name as a JSON string.
    named: Finder<'static>,
    /// Latest undecoded record by VM name, with its revision.
    records: HashMap<String, (Revision, Vec<u8>)>,
}

impl DeferredRecords {
    /// Keeps the records that cannot concern `node`.
    pub fn for_node(node: &str) -> Self {
        Self {
            named: Finder::new(format!("\"{node}\"").as_bytes()).into_owned(),
            records: HashMap::new(),
        }
    }

    /// Whether `value` (a record as stored) names the node anywhere.
    pub fn names_node(&self, value: &[u8]) -> bool {
        self.named.find(value).is_some()
    }

    /// `name`'s record as written at `revision`, replacing an older one.
    pub fn keep(&mut self, name: &str, revision: Revision, value: &[u8]) {
        match self.records.get_mut(name) {
            Some(held) if held.0 >= revision => {}
            Some(held) => *held = (revision, value.to_vec()),
            None => {
                self.records
                    .insert(name.to_string(), (revision, value.to_vec()));
            }
        }
    }

    /// The revision of `name`'s record kept here, if any.
    pub fn revision_of(&self, name: &str) -> Option<Revision> {
        self.records.get(name).map(|(revision, _)| *revision)
    }

    /// Drops `name`'s record if it is no newer than `revision` (a newer
    /// record of it, or its deletion, has been taken in).
    pub fn superseded(&mut self, name: &str, revision: Revision) {
        if self.revision_of(name).is_some_and(|kept| kept <= revision) {
            self.records.remove(name);
        }
    }

    /// Takes every record out, to be decoded.
    pub fn take_all(&mut self) -> Vec<(String, Revision, Vec<u8>)> {
        self.records
            .drain()
            .map(|(name, (revision, value))| (name, revision, value))
            .collect()
    }

    /// Takes the records of `names` out, to be decoded.
    pub fn take<'a>(
        &mut self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Vec<(String, Revision, Vec<u8>)> {
        names
            .into_iter()
            .filter_map(|name| self.records.remove_entry(name))
            .map(|(name, (revision, value))| (name, revision, value))
            .collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.records.contains_key(name)
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_named_only_as_a_whole_string() {
        let kept = DeferredRecords::for_node("n1");
        assert!(kept.names_node(br#"{"status":{"node":"n1"}}"#));
        assert!(!kept.names_node(br#"{"status":{"node":"n10"}}"#));
        assert!(!kept.names_node(br#"{"name":"xn1","node":"n2"}"#));
    }

    #[test]
    fn an_older_record_never_replaces_a_newer_one() {
        let mut kept = DeferredRecords::for_node("n1");
        kept.keep("a", 5, b"five");
        kept.keep("a", 4, b"four");
        assert_eq!(kept.revision_of("a"), Some(5));
        kept.superseded("a", 4);
        assert!(kept.contains("a"), "a deletion older than the record");
        kept.superseded("a", 6);
        assert!(kept.is_empty());
    }
}
