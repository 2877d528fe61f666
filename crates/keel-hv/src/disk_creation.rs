//! Which disks a start may make where they are missing: the controller
//! decides it per disk from the VM's disk records, and every driver keeps
//! to it. A disk it may not make must exist, or the start fails naming it
//! before anything is made: never a blank disk in place of the VM's own.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DiskCreation {
    /// These disks (by name) may be made; every other must exist.
    Only(Vec<String>),
    /// A launch record from before per-disk permission: every disk
    /// (`true`, also what a record without the field means) or none.
    Legacy(bool),
}

impl DiskCreation {
    /// No disk may be made: all must exist (an incoming migration's
    /// target, a snapshot).
    pub fn none() -> Self {
        DiskCreation::Only(Vec::new())
    }

    /// Every disk of `disks` may be made (a VM's first start).
    pub fn all_of(disks: &[keel_api::DiskSpec]) -> Self {
        DiskCreation::Only(disks.iter().map(|d| d.name.clone()).collect())
    }

    pub fn allows(&self, disk: &str) -> bool {
        match self {
            DiskCreation::Only(names) => names.iter().any(|n| n == disk),
            DiskCreation::Legacy(all) => *all,
        }
    }
}

impl Default for DiskCreation {
    /// Launch records written before `create_disks` existed came from
    /// starts that created disks as needed.
    fn default() -> Self {
        DiskCreation::Legacy(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Launch {
        #[serde(default)]
        create_disks: DiskCreation,
    }

    fn decode(json: &str) -> DiskCreation {
        serde_json::from_str::<Launch>(json).unwrap().create_disks
    }

    #[test]
    fn old_launch_records_decode_to_what_they_meant() {
        assert!(decode(r#"{}"#).allows("any"));
        assert!(decode(r#"{"create_disks":true}"#).allows("any"));
        assert!(!decode(r#"{"create_disks":false}"#).allows("any"));
        let only = decode(r#"{"create_disks":["extra"]}"#);
        assert!(only.allows("extra") && !only.allows("root"));
        assert_eq!(
            serde_json::to_string(&DiskCreation::Only(vec!["x".into()])).unwrap(),
            r#"["x"]"#
        );
    }
}
