//! What an instance was started with, of the spec fields that only a new
//! instance takes (QEMU's command line, the seed, the NIC's backend): a
//! change of one of them on a running VM waits for a restart, and the
//! difference is shown as the VM's `restart_required`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StartedWith {
    /// The spec generation the instance was started from.
    pub generation: u64,
    pub cpus: u32,
    pub memory_mib: u64,
    /// The disks by name, in the spec's order (the first is the boot
    /// disk). A disk's size is not here: it only grows (`keel vm disk
    /// resize`), under a running instance (`Instance::disk_sizes_mib`) or
    /// by the next start.
    pub disks: Vec<String>,
    /// Digests ([`digest`]) of `spec.boot`, the NIC and `spec.cloud_init`:
    /// the values can be large (user-data), only a change matters.
    pub boot: String,
    pub network: String,
    pub cloud_init: String,
    /// `spec.cpu_model` at the start (`None`: unnamed, or a record from
    /// before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
    /// Whether it was started with a TPM (`spec.tpm`); `false` on records
    /// from before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tpm: bool,
}

/// A digest of `value`'s JSON that stays the same across builds and
/// processes (FNV-1a, 64 bits, in hex), to tell whether a field changed.
pub fn digest(value: &impl Serialize) -> String {
    let bytes = serde_json::to_vec(value).expect("spec fields serialize");
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn digests_are_fixed_and_tell_values_apart() {
        assert_eq!(super::digest(&"a"), super::digest(&"a"));
        assert_ne!(super::digest(&"a"), super::digest(&"b"));
        // FNV-1a of `null`, the same in every build.
        assert_eq!(super::digest(&()), "5b9bc4ba528108e4");
    }
}
