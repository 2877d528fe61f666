//! Where each resource lives in the store.

pub const VMS_PREFIX: &str = "/vms/";
pub const NODES_PREFIX: &str = "/nodes/";
pub const SNAPSHOTS_PREFIX: &str = "/snapshots/";
pub const IMAGES_PREFIX: &str = "/images/";

/// The control planes' leader key: created under the leader's lease, so it
/// disappears when the leader stops renewing it. Its `create_revision` is
/// the guard of every cluster-level write the leader makes.
pub const LEADER_KEY: &str = "/leader";

/// The API token every control plane of a distributed cluster accepts.
/// Written in clear by versions before scoped tokens; a control plane
/// that finds it turns it into a hashed token record and deletes it.
pub const API_TOKEN_KEY: &str = "/config/api-token";

/// API tokens by id: hashes of their secrets, never the secrets.
pub const TOKENS_PREFIX: &str = "/tokens/";

pub fn token_key(id: &str) -> String {
    format!("{TOKENS_PREFIX}{id}")
}

/// The audit trail's events are kept under this name, which no VM can
/// have: `/events/_audit/...`.
pub const AUDIT_EVENTS: &str = "_audit";

pub fn vm_key(name: &str) -> String {
    format!("{VMS_PREFIX}{name}")
}

pub fn image_key(name: &str) -> String {
    format!("{IMAGES_PREFIX}{name}")
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

/// Events about records that belong to no VM (a node's, say) are kept under
/// this name, which no VM can have (names are `[a-z0-9-]`).
pub const STORE_EVENTS: &str = "_store";

/// The VM whose events tell about a problem with the record at `key`: the
/// VM itself, or the VM a snapshot, migration or event belongs to;
/// [`STORE_EVENTS`] for anything else.
pub fn event_subject(key: &str) -> &str {
    if let Some(name) = name_of(VMS_PREFIX, key) {
        return name;
    }
    for prefix in [SNAPSHOTS_PREFIX, MIGRATIONS_PREFIX, EVENTS_PREFIX] {
        if let Some((vm, _)) = key.strip_prefix(prefix).and_then(|r| r.split_once('/')) {
            if !vm.is_empty() {
                return vm;
            }
        }
    }
    STORE_EVENTS
}

/// Events about the record at a store revision (one found undecodable
/// at it, say; before atomic writes, also the phase change written at it)
/// sort by that revision.
pub fn event_key(vm: &str, revision: u64) -> String {
    format!("{EVENTS_PREFIX}{vm}/{revision:020}")
}

/// The `index`th event of a change to a VM's record written *from*
/// `revision` (its compare-and-swap precondition) in the same store write:
/// known before the commit and unique, as a write succeeds from a revision
/// at most once. It sorts after [`event_key`] at that revision (what
/// happened at `from`) and before anything at a later one, so a VM's
/// events stay in the order they happened.
pub fn change_event_key(vm: &str, from: u64, index: usize) -> String {
    format!("{EVENTS_PREFIX}{vm}/{from:020}-{index:02}")
}

pub fn snapshot_key(vm: &str, name: &str) -> String {
    format!("{SNAPSHOTS_PREFIX}{vm}/{name}")
}

/// All snapshots of one VM.
pub fn snapshots_of_prefix(vm: &str) -> String {
    format!("{SNAPSHOTS_PREFIX}{vm}/")
}

/// `(vm, snapshot)` of a snapshot key.
pub fn snapshot_of(key: &str) -> Option<(&str, &str)> {
    let rest = key.strip_prefix(SNAPSHOTS_PREFIX)?;
    let (vm, name) = rest.split_once('/')?;
    (!vm.is_empty() && !name.is_empty() && !name.contains('/')).then_some((vm, name))
}

pub const MIGRATIONS_PREFIX: &str = "/migrations/";

pub fn migration_key(vm: &str, id: &str) -> String {
    format!("{MIGRATIONS_PREFIX}{vm}/{id}")
}

pub fn migrations_of_prefix(vm: &str) -> String {
    format!("{MIGRATIONS_PREFIX}{vm}/")
}

/// `(vm, id)` of a migration key.
pub fn migration_of(key: &str) -> Option<(&str, &str)> {
    let rest = key.strip_prefix(MIGRATIONS_PREFIX)?;
    let (vm, id) = rest.split_once('/')?;
    (!vm.is_empty() && !id.is_empty() && !id.contains('/')).then_some((vm, id))
}
