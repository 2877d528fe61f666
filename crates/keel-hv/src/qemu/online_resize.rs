//! A disk grown under a running guest (`keel vm disk resize` of a running
//! VM): QMP `block_resize` on the disk QEMU has open on the disk's file.
//! The image's header takes the new size at once, so the growth outlives
//! the process (the next start finds the file at its size), and virtio-blk
//! tells the guest its capacity changed.
//!
//! Never a shrink: the size QEMU has open is read first (`query-block`),
//! and a disk already as large or larger is left alone. So a repeated
//! request (the controller's write after the resize lost a race, say) is a
//! no-op, and a file larger than its spec (made from a larger image) is
//! never cut.

use serde_json::json;

use super::query_block::BlockInfo;
use super::QemuDriver;
use crate::HvError;

const OP: &str = "grow a disk online";

impl QemuDriver {
    pub(super) async fn grow_disk_online(
        &self,
        vm: &str,
        instance: &str,
        disk: &str,
        size_mib: u64,
    ) -> Result<(), HvError> {
        let monitor = self.live_monitor(instance, OP).await?;
        let blocks: Vec<BlockInfo> = monitor.query("query-block").await?;
        let file = self.disk_path(vm, disk);
        let Some((block, open)) = blocks.iter().find_map(|b| Some((b, b.open_on(&file)?))) else {
            return Err(monitor.failed(format!(
                "disk {disk} ({}) is not open in this instance; it takes the new size at its \
                 next start",
                file.display()
            )));
        };
        let wanted = size_mib << 20;
        if open.image.virtual_size >= wanted {
            return Ok(());
        }
        // A disk of the command line by its backend, a plugged one (whose
        // backend has no name) by its node.
        let mut args = match block.name() {
            Some(name) if name == block.device => json!({"device": name}),
            Some(node) => json!({"node-name": node}),
            None => return Err(monitor.failed(format!("disk {disk} has no name in QEMU"))),
        };
        args["size"] = json!(wanted);
        tracing::info!(%vm, %instance, %disk, size_mib, "growing a disk under its running guest");
        monitor.execute("block_resize", Some(args)).await?;
        Ok(())
    }
}
