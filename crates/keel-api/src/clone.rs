//! A new VM made from another's snapshot (`keel vm clone SRC NEW
//! --snapshot S`): the spec the snapshot recorded, with an identity of its
//! own, and disks that are copies of the source's at the snapshot.
//!
//! Why from a snapshot, always: it is one consistent moment of every disk
//! (a running guest is paused for it), it does not change while the copy
//! is made (the source may run and write meanwhile), and the copy can be
//! made whenever the clone first starts. The CLI takes one first when none
//! is named.
//!
//! What is the clone's own: its name, uid, MAC and cloud-init instance-id
//! (so its guest is a new machine to cloud-init: its hostname is the new
//! name), and no published host ports (the source holds them). It starts
//! on a node that sees the source's disks (its disk home is theirs).

use crate::clone_source::CloneSource;
use crate::snapshot::{Snapshot, SnapshotPhase};
use crate::validation::ValidationError;
use crate::vm::{PowerState, VirtualMachine};

impl VirtualMachine {
    /// The clone `name` of this VM at `snapshot` (one of its own, ready),
    /// powered on or not. `random` gives its MAC and instance-id.
    pub fn clone_at(
        &self,
        name: &str,
        snapshot: &Snapshot,
        power: PowerState,
        random: [u8; 12],
    ) -> Result<VirtualMachine, ValidationError> {
        crate::validate_name("name", name)?;
        if snapshot.vm != self.name {
            return Err(ValidationError::new(
                "snapshot",
                format!(
                    "snapshot {} is not one of VM {}'s",
                    snapshot.name, self.name
                ),
            ));
        }
        if snapshot.status.phase != SnapshotPhase::Ready || snapshot.deletion_requested_at.is_some()
        {
            return Err(ValidationError::new(
                "snapshot",
                format!(
                    "snapshot {} of VM {} is not ready ({:?}{}): a clone is made from a \
                     snapshot that holds the disks",
                    snapshot.name,
                    self.name,
                    snapshot.status.phase,
                    if snapshot.deletion_requested_at.is_some() {
                        ", being deleted"
                    } else {
                        ""
                    }
                ),
            ));
        }
        let Some(home) = self.status.disk_home.clone() else {
            return Err(ValidationError::new(
                "vm",
                format!("VM {} has no disks yet to clone", self.name),
            ));
        };
        let spec = snapshot.spec.clone().for_new_vm(power, random, false);
        let mut clone = VirtualMachine::new(name, spec);
        clone.status.disk_home = Some(home);
        clone.status.clone_from = Some(CloneSource {
            vm: self.name.clone(),
            vm_uid: self.uid.clone(),
            snapshot: snapshot.name.clone(),
            disks: snapshot
                .spec
                .disk_names()
                .iter()
                .map(|d| d.to_string())
                .collect(),
            linked: false,
        });
        clone.validate()?;
        Ok(clone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::SnapshotStatus;
    use crate::vm::tests::spec;
    use crate::{CloudInitSpec, DiskHome};

    fn source() -> (VirtualMachine, Snapshot) {
        let mut s = spec();
        s.assign_identity([1; 12]);
        s.cloud_init = Some(CloudInitSpec {
            user_data: Some("#cloud-config\n".into()),
            instance_id: Some("i-source".into()),
            ..Default::default()
        });
        s.network.publish = vec!["127.0.0.1:2222:22".parse().unwrap()];
        let mut vm = VirtualMachine::new("src", s.clone());
        vm.uid = "u1".into();
        vm.status.disk_home = Some(DiskHome::Node("a".into()));
        let snap = Snapshot {
            vm: "src".into(),
            name: "s1".into(),
            spec: s,
            requested_at: 5,
            deletion_requested_at: None,
            status: SnapshotStatus {
                phase: SnapshotPhase::Ready,
                ..Default::default()
            },
        };
        (vm, snap)
    }

    #[test]
    fn a_clone_has_the_snapshots_spec_and_an_identity_of_its_own() {
        let (src, snap) = source();
        let clone = src
            .clone_at("copy", &snap, PowerState::Stopped, [2; 12])
            .unwrap();
        assert_eq!(clone.name, "copy");
        assert_eq!(clone.spec.disks, snap.spec.disks);
        assert_ne!(clone.spec.network.mac, src.spec.network.mac);
        assert!(clone.spec.network.mac.is_some());
        let iid = clone.spec.cloud_init.as_ref().unwrap().instance_id.clone();
        assert!(
            iid.is_some() && iid.as_deref() != Some("i-source"),
            "{iid:?}"
        );
        assert!(clone.spec.network.publish.is_empty());
        assert_eq!(clone.spec.power, PowerState::Stopped);
        assert_eq!(clone.status.disk_home, src.status.disk_home);
        let from = clone.status.clone_from.unwrap();
        assert_eq!(
            (
                from.vm.as_str(),
                from.vm_uid.as_str(),
                from.snapshot.as_str()
            ),
            ("src", "u1", "s1")
        );
        assert_eq!(from.disks, snap.spec.disk_names());
        assert!(clone.status.disks.is_none(), "nothing made yet");
    }

    #[test]
    fn only_from_a_ready_snapshot_of_its_own_disks() {
        let (src, mut snap) = source();
        let bad_name = src.clone_at("No Good", &snap, PowerState::Stopped, [2; 12]);
        assert_eq!(bad_name.unwrap_err().field, "name");
        snap.status.phase = SnapshotPhase::Pending;
        let pending = src.clone_at("copy", &snap, PowerState::Stopped, [2; 12]);
        assert_eq!(pending.unwrap_err().field, "snapshot");
        snap.status.phase = SnapshotPhase::Ready;
        snap.vm = "other".into();
        let foreign = src.clone_at("copy", &snap, PowerState::Stopped, [2; 12]);
        assert_eq!(foreign.unwrap_err().field, "snapshot");
        let (mut fresh, snap) = source();
        fresh.status.disk_home = None;
        let none = fresh.clone_at("copy", &snap, PowerState::Stopped, [2; 12]);
        assert_eq!(none.unwrap_err().field, "vm");
    }
}
