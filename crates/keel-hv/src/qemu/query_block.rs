//! What `query-block` answers (and `qemu-img info --output=json`, whose
//! image part has the same shape), of the fields Keel reads: the disks a
//! live QEMU has open, by file, and how QMP commands name each.

use std::path::Path;

use serde::Deserialize;

/// One entry of `query-block`.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct BlockInfo {
    /// The block backend's name: `diskN` for a disk of the command line,
    /// empty for a plugged disk (`blockdev-add` makes no named backend).
    pub device: String,
    #[serde(default)]
    pub inserted: Option<Inserted>,
}

#[derive(Debug, Clone, Deserialize)]
pub(super) struct Inserted {
    pub file: String,
    #[serde(default)]
    pub image: ImageInfo,
    #[serde(default, rename = "node-name")]
    pub node_name: String,
}

/// An image as `query-block` and `qemu-img info` describe it.
#[derive(Debug, Clone, Default, Deserialize)]
pub(super) struct ImageInfo {
    /// The size the guest sees, in bytes.
    #[serde(default, rename = "virtual-size")]
    pub virtual_size: u64,
    #[serde(default)]
    pub snapshots: Vec<SnapshotName>,
}

#[derive(Debug, Clone, Deserialize)]
pub(super) struct SnapshotName {
    pub name: String,
}

impl ImageInfo {
    pub fn has(&self, name: &str) -> bool {
        self.snapshots.iter().any(|s| s.name == name)
    }
}

impl BlockInfo {
    /// The disk open on `file`, if this entry is it.
    pub fn open_on(&self, file: &Path) -> Option<&Inserted> {
        self.inserted
            .as_ref()
            .filter(|i| Path::new(&i.file) == file)
    }

    /// How QMP commands that take a device or a node name it: the
    /// backend's name, or for a plugged disk (whose backend has none) its
    /// node's.
    pub fn name(&self) -> Option<&str> {
        match (&self.inserted, self.device.is_empty()) {
            (_, false) => Some(&self.device),
            (Some(i), true) if !i.node_name.is_empty() => Some(&i.node_name),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn disks_are_found_by_file_and_named_by_backend_or_node() {
        let blocks: Vec<BlockInfo> = serde_json::from_value(json!([
            {"device": "cd0"},
            {"device": "disk1", "inserted": {"file": "/d/web/data.qcow2",
                "image": {"virtual-size": 2097152}, "node-name": "#block123"}},
            {"device": "", "qdev": "plugged-logs", "inserted": {"file": "/d/web/logs.qcow2",
                "image": {"virtual-size": 4194304, "snapshots": [{"name": "s1"}]},
                "node-name": "plugged-logs"}},
        ]))
        .unwrap();
        let data = Path::new("/d/web/data.qcow2");
        assert!(blocks[0].open_on(data).is_none());
        assert_eq!(blocks[1].open_on(data).unwrap().image.virtual_size, 2 << 20);
        assert_eq!(blocks[1].name(), Some("disk1"));
        // A plugged disk: its node stands for it.
        assert_eq!(blocks[2].name(), Some("plugged-logs"));
        assert!(blocks[2].inserted.as_ref().unwrap().image.has("s1"));
    }
}
