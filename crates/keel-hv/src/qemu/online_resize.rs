//! A disk grown under a running guest (`keel vm disk resize` of a running
//! VM): QMP `block_resize` on the block backend QEMU has open on the disk's
//! file. The image's header takes the new size at once, so the growth
//! outlives the process (the next start finds the file at its size), and
//! virtio-blk tells the guest its capacity changed.
//!
//! Never a shrink: the size QEMU has open is read first (`query-block`),
//! and a disk already as large or larger is left alone. So a repeated
//! request (the controller's write after the resize lost a race, say) is a
//! no-op, and a file larger than its spec (made from a larger image) is
//! never cut.

use serde::Deserialize;
use serde_json::json;

use super::monitor::Phase;
use super::qmp::QmpError;
use super::{unavailable, QemuDriver};
use crate::HvError;

const OP: &str = "grow a disk online";

/// One entry of `query-block`, of the fields needed here.
#[derive(Debug, Clone, Deserialize)]
struct BlockInfo {
    device: String,
    #[serde(default)]
    inserted: Option<Inserted>,
}

#[derive(Debug, Clone, Deserialize)]
struct Inserted {
    file: String,
    image: ImageSize,
    #[serde(default, rename = "node-name")]
    node_name: String,
}

#[derive(Debug, Clone, Deserialize)]
struct ImageSize {
    #[serde(rename = "virtual-size")]
    virtual_size: u64,
}

/// How `block_resize` names the disk open on `file` (its backend, or for
/// a plugged disk, whose backend has no name, its node), and the disk's
/// guest-visible size in bytes.
fn open_on(blocks: Vec<BlockInfo>, file: &std::path::Path) -> Option<(serde_json::Value, u64)> {
    blocks.into_iter().find_map(|b| {
        let inserted = b.inserted?;
        if std::path::Path::new(&inserted.file) != file {
            return None;
        }
        let name = if b.device.is_empty() {
            json!({"node-name": inserted.node_name})
        } else {
            json!({"device": b.device})
        };
        Some((name, inserted.image.virtual_size))
    })
}

impl QemuDriver {
    pub(super) async fn grow_disk_online(
        &self,
        vm: &str,
        instance: &str,
        disk: &str,
        size_mib: u64,
    ) -> Result<(), HvError> {
        let domain = self.existing(instance, OP)?;
        let failed = |reason: String| HvError::Failed {
            instance: instance.to_string(),
            op: OP,
            reason,
        };
        match domain.phase() {
            Phase::Live { .. } => {}
            Phase::Launching { .. } => {
                return Err(unavailable(instance, OP, "QEMU is still launching".into()))
            }
            Phase::Exited(_) => return Err(failed("the instance has exited".into())),
        }
        let client = domain
            .qmp()
            .await
            .map_err(|e| unavailable(instance, OP, e))?;
        let qmp = |e: QmpError| match e {
            QmpError::Command { .. } => failed(e.to_string()),
            other => unavailable(instance, OP, other.to_string()),
        };
        let blocks: Vec<BlockInfo> =
            serde_json::from_value(client.execute("query-block", None).await.map_err(qmp)?)
                .map_err(|e| failed(format!("query-block result: {e}")))?;
        let file = self.disk_path(vm, disk);
        let Some((mut args, size)) = open_on(blocks, &file) else {
            return Err(failed(format!(
                "disk {disk} ({}) is not open in this instance; it takes the new size at its \
                 next start",
                file.display()
            )));
        };
        let wanted = size_mib << 20;
        if size >= wanted {
            return Ok(());
        }
        tracing::info!(%vm, %instance, %disk, size_mib, "growing a disk under its running guest");
        args["size"] = json!(wanted);
        client
            .execute("block_resize", Some(args))
            .await
            .map_err(qmp)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_is_found_by_its_file_and_empty_drives_are_skipped() {
        let blocks: Vec<BlockInfo> = serde_json::from_value(json!([
            {"device": "cd0"},
            {"device": "disk0", "inserted": {"file": "/d/web/root.qcow2",
                "image": {"virtual-size": 1048576, "filename": "/d/web/root.qcow2"}}},
            {"device": "disk1", "inserted": {"file": "/d/web/data.qcow2",
                "image": {"virtual-size": 2097152}, "node-name": "#block123"}},
            {"device": "", "qdev": "plugged-logs", "inserted": {"file": "/d/web/logs.qcow2",
                "image": {"virtual-size": 4194304}, "node-name": "plugged-logs"}},
        ]))
        .unwrap();
        let find = |file: &str| open_on(blocks.clone(), std::path::Path::new(file));
        assert_eq!(
            find("/d/web/data.qcow2"),
            Some((json!({"device": "disk1"}), 2 << 20))
        );
        // A plugged disk's backend has no name: its node stands for it.
        assert_eq!(
            find("/d/web/logs.qcow2"),
            Some((json!({"node-name": "plugged-logs"}), 4 << 20))
        );
        assert_eq!(find("/d/web/other.qcow2"), None);
    }
}
