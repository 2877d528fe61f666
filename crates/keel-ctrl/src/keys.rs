//! Where each resource lives in the store.

pub const VMS_PREFIX: &str = "/vms/";
pub const NODES_PREFIX: &str = "/nodes/";

pub fn vm_key(name: &str) -> String {
    format!("{VMS_PREFIX}{name}")
}

pub fn node_key(name: &str) -> String {
    format!("{NODES_PREFIX}{name}")
}

/// The resource name of a key under `prefix`, if it is one.
pub fn name_of<'a>(prefix: &str, key: &'a str) -> Option<&'a str> {
    key.strip_prefix(prefix)
        .filter(|n| !n.is_empty() && !n.contains('/'))
}

pub const EVENTS_PREFIX: &str = "/events/";

/// Events of one VM sort by the store revision of the change they record.
pub fn event_key(vm: &str, revision: u64) -> String {
    format!("{EVENTS_PREFIX}{vm}/{revision:020}")
}
