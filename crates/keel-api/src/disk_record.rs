//! What a VM's status knows of each of its disks: that a start was allowed
//! to make it, when and where, and whether an instance has run on it.
//!
//! The fencing rule, per disk: a disk an instance has run on holds the
//! VM's data, so it must exist wherever the VM starts and is never made
//! again (a VM never boots on a blank disk in place of its own); a disk
//! no instance has run on may be made, on the VM's disk home. A disk
//! dropped from the spec keeps its record once it was used, so adding it
//! back under the same name means the old disk, never a blank one.

use serde::{Deserialize, Serialize};

use crate::Millis;

/// Where a VM's disks are, as the nodes that can see them say.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DiskHome {
    /// In the node's own disk dir: only this node sees them.
    Node(String),
    /// In a directory shared by every node that mounts it at this path.
    Shared(String),
}

impl std::fmt::Display for DiskHome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiskHome::Node(node) => write!(f, "node-local storage on node {node}"),
            DiskHome::Shared(dir) => write!(f, "shared storage {dir}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DiskRecord {
    pub name: String,
    /// When the first start that could make it was recorded (the record is
    /// written before the node is asked to start). `None`: made before
    /// Keel kept per-disk records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub made_at: Option<Millis>,
    /// Where it was made: the VM's disk home then.
    pub home: DiskHome,
    /// An instance was seen running on it: from now on it must exist.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub used: bool,
}

/// The records as this build reads them. `stored` is `None` on a record
/// written before per-disk records (or rewritten by such a build during a
/// rolling upgrade, which drops what it does not know): if an instance has
/// run then (`legacy_ran`), every disk `spec_disks` names counts as made
/// and used — the safe reading, since which of them existed then is not
/// known — and none otherwise.
pub fn read(
    stored: Option<&[DiskRecord]>,
    legacy_ran: bool,
    spec_disks: &[&str],
    home: &DiskHome,
) -> Vec<DiskRecord> {
    match stored {
        Some(records) => records.to_vec(),
        None if legacy_ran => spec_disks
            .iter()
            .map(|name| DiskRecord {
                name: name.to_string(),
                made_at: None,
                home: home.clone(),
                used: true,
            })
            .collect(),
        None => Vec::new(),
    }
}

/// Records a start about to be asked of a node whose disk home is `here`:
/// each disk of the spec without a record gets one (made now, here). A
/// record of a disk no longer in the spec that no instance ran on is
/// dropped (it holds nothing; made again, it is as blank as it was); a
/// used one stays.
pub fn record_start(
    records: &mut Vec<DiskRecord>,
    spec_disks: &[&str],
    here: &DiskHome,
    now: Millis,
) {
    records.retain(|r| r.used || spec_disks.contains(&r.name.as_str()));
    for name in spec_disks {
        record_plug(records, name, here, now);
    }
}

/// Records disk `name` about to be made (or found) here for a running
/// instance (a plugged disk): a record of it, if it has none yet. The
/// other records stay as they are.
pub fn record_plug(records: &mut Vec<DiskRecord>, name: &str, here: &DiskHome, now: Millis) {
    if !records.iter().any(|r| r.name == name) {
        records.push(DiskRecord {
            name: name.to_string(),
            made_at: Some(now),
            home: here.clone(),
            used: false,
        });
    }
}

/// The disks of the spec a start on a node whose disk home is `here` may
/// make where they are missing: those never made, and those made here
/// that no instance has run on. Every other one must exist.
pub fn makeable(records: &[DiskRecord], spec_disks: &[&str], here: &DiskHome) -> Vec<String> {
    spec_disks
        .iter()
        .filter(|name| {
            records
                .iter()
                .find(|r| r.name == **name)
                .is_none_or(|r| !r.used && r.home == *here)
        })
        .map(|name| name.to_string())
        .collect()
}

/// An instance started with `started` (disk names) was seen running on
/// them: each is used from now on (one without a record, which a start
/// always writes, gets one, made at an unknown time).
pub fn mark_used(records: &mut Vec<DiskRecord>, started: &[String], home: &DiskHome) {
    for name in started {
        match records.iter_mut().find(|r| r.name == *name) {
            Some(r) => r.used = true,
            None => records.push(DiskRecord {
                name: name.clone(),
                made_at: None,
                home: home.clone(),
                used: true,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn here() -> DiskHome {
        DiskHome::Node("a".into())
    }

    #[test]
    fn a_used_disk_must_exist_and_a_new_one_may_be_made() {
        let mut records = read(Some(&[]), true, &["root"], &here());
        record_start(&mut records, &["root"], &here(), 10);
        assert_eq!(makeable(&records, &["root"], &here()), ["root"]);
        mark_used(&mut records, &["root".into()], &here());
        record_start(&mut records, &["root", "extra"], &here(), 20);
        assert_eq!(makeable(&records, &["root", "extra"], &here()), ["extra"]);
        let extra = records.iter().find(|r| r.name == "extra").unwrap();
        assert_eq!((extra.made_at, extra.used), (Some(20), false));
        // Made here, unused: not made on another home.
        let elsewhere = DiskHome::Node("b".into());
        assert!(makeable(&records, &["extra"], &elsewhere).is_empty());
    }

    #[test]
    fn a_used_disk_dropped_from_the_spec_keeps_its_record() {
        let mut records = Vec::new();
        record_start(&mut records, &["a", "b"], &here(), 1);
        mark_used(&mut records, &["a".into()], &here());
        record_start(&mut records, &[], &here(), 2);
        assert_eq!(
            records.len(),
            1,
            "unused b dropped, used a kept: {records:?}"
        );
        record_start(&mut records, &["a"], &here(), 3);
        assert!(makeable(&records, &["a"], &here()).is_empty());
    }

    #[test]
    fn old_records_read_safely() {
        // Ran before per-disk records: every disk of the spec is used.
        let records = read(None, true, &["root", "extra"], &here());
        assert!(records.iter().all(|r| r.used && r.made_at.is_none()));
        assert!(makeable(&records, &["root", "extra"], &here()).is_empty());
        // Never ran: nothing made yet.
        assert!(read(None, false, &["root"], &here()).is_empty());
    }
}
