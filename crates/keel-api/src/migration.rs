//! A live migration attempt. Created exactly once per attempt (the id is
//! reserved on the VM record first, the record is then created only if
//! absent), and never reused: a new attempt gets a new id.

use serde::{Deserialize, Serialize};

use crate::{Millis, ValidationError};

pub const DEFAULT_COMPLETION_TIMEOUT_PER_GIB_S: u64 = 150;
pub const DEFAULT_PROGRESS_TIMEOUT_S: u64 = 150;
pub const DEFAULT_PARALLEL_MIGRATIONS_PER_CLUSTER: u32 = 5;
pub const DEFAULT_PARALLEL_MIGRATIONS_PER_NODE: u32 = 2;
/// Bounds of a drain's migration tuning, checked by
/// `MigrationTuning::validate` and published in the OpenAPI document.
pub const MAX_MIGRATION_TIMEOUT_S: u64 = 86_400;
pub const MAX_BANDWIDTH_MIB_S: u64 = 1 << 20;
pub const MAX_DOWNTIME_LIMIT_MS: u64 = 60_000;
pub const MAX_PARALLEL_MIGRATIONS: u64 = 1000;

/// How live migrations of a drain are run and bounded. Recorded on the
/// drain and copied onto each migration it creates, so a migration is run
/// by the settings it was created with.
///
/// Post-copy is never used: Keel migrates pre-copy only (a post-copy
/// switch-over cannot be undone if the link fails, and there is no opt-in
/// for it yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct MigrationTuning {
    /// A migration running longer than this per GiB of guest memory
    /// (rounded up) is cancelled; the drain's migrate window bounds it too.
    pub completion_timeout_per_gib_s: u64,
    /// A migration whose transferred bytes have not grown for this long is
    /// cancelled.
    pub progress_timeout_s: u64,
    /// Bandwidth cap in MiB/s; `None`: the node's setting (QEMU: 128 MiB/s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bandwidth_mib_s: Option<u64>,
    /// Throttle the guest's CPUs when it dirties memory faster than it is
    /// sent, so the migration converges.
    pub auto_converge: bool,
    /// The longest pause at switch-over, in ms; `None`: the hypervisor's
    /// default (QEMU: 300 ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downtime_limit_ms: Option<u64>,
    /// At most this many migrations in flight across the cluster.
    pub parallel_per_cluster: u32,
    /// At most this many migrations in flight into or out of one node.
    pub parallel_per_node: u32,
}

impl Default for MigrationTuning {
    fn default() -> Self {
        Self {
            completion_timeout_per_gib_s: DEFAULT_COMPLETION_TIMEOUT_PER_GIB_S,
            progress_timeout_s: DEFAULT_PROGRESS_TIMEOUT_S,
            bandwidth_mib_s: None,
            auto_converge: true,
            downtime_limit_ms: None,
            parallel_per_cluster: DEFAULT_PARALLEL_MIGRATIONS_PER_CLUSTER,
            parallel_per_node: DEFAULT_PARALLEL_MIGRATIONS_PER_NODE,
        }
    }
}

impl MigrationTuning {
    /// How long a migration of a guest with `memory_mib` may run.
    pub fn completion_timeout_ms(&self, memory_mib: u64) -> Millis {
        let gib = memory_mib.div_ceil(1024).max(1);
        self.completion_timeout_per_gib_s
            .saturating_mul(gib)
            .saturating_mul(1000)
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        let range = |field: &str, v: u64, lo: u64, hi: u64| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(ValidationError::new(
                    format!("tuning.{field}"),
                    format!("{v} is out of range {lo}..={hi}"),
                ))
            }
        };
        range(
            "completion_timeout_per_gib_s",
            self.completion_timeout_per_gib_s,
            1,
            MAX_MIGRATION_TIMEOUT_S,
        )?;
        range(
            "progress_timeout_s",
            self.progress_timeout_s,
            1,
            MAX_MIGRATION_TIMEOUT_S,
        )?;
        if let Some(b) = self.bandwidth_mib_s {
            range("bandwidth_mib_s", b, 1, MAX_BANDWIDTH_MIB_S)?;
        }
        if let Some(d) = self.downtime_limit_ms {
            range("downtime_limit_ms", d, 1, MAX_DOWNTIME_LIMIT_MS)?;
        }
        range(
            "parallel_per_cluster",
            self.parallel_per_cluster.into(),
            1,
            MAX_PARALLEL_MIGRATIONS,
        )?;
        range(
            "parallel_per_node",
            self.parallel_per_node.into(),
            1,
            MAX_PARALLEL_MIGRATIONS,
        )
    }
}

/// How a migration stream travels, as told by the URI its target listens
/// at: `unix:` (one host), `tcp:` (plain, only with the nodes'
/// `--insecure-migration`) or Keel's `tls+tcp:` (QEMU's TLS, both ends
/// verified against the cluster CA).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub enum MigrationTransport {
    #[serde(rename = "unix")]
    Unix,
    #[serde(rename = "tcp")]
    Tcp,
    /// Shown as `tcp+tls`, in records as in tables.
    #[serde(rename = "tcp+tls")]
    TcpTls,
}

impl MigrationTransport {
    pub fn of_uri(uri: &str) -> Option<Self> {
        if uri.starts_with("unix:") {
            Some(Self::Unix)
        } else if uri.starts_with("tls+tcp:") {
            Some(Self::TcpTls)
        } else if uri.starts_with("tcp:") {
            Some(Self::Tcp)
        } else {
            None
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unix => "unix",
            Self::Tcp => "tcp",
            Self::TcpTls => "tcp+tls",
        }
    }
}

impl std::fmt::Display for MigrationTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where and how a node receives live migrations (on its record).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MigrationEndpoint {
    pub transport: MigrationTransport,
    /// `ADDR:FIRST-LAST` for TCP; `None` for a Unix socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Migration {
    /// `m<seq>-<vm uid>`, unique across deletes and re-creations of the VM
    /// (`<vm>-m<seq>` for VMs from before uids).
    pub id: String,
    pub vm: String,
    /// The uid of the VM this migration was made for (empty: from before
    /// uids). A VM of the same name created later never adopts it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub vm_uid: String,
    pub source_node: String,
    pub source_instance: String,
    pub target_node: String,
    pub target_instance: String,
    pub created_at: Millis,
    /// The drain's tuning when this migration was created.
    #[serde(default)]
    pub tuning: MigrationTuning,
    #[serde(default)]
    pub status: MigrationStatus,
}

/// A migration that has not started sending by then is given up (Failed,
/// with the reason): counted from its creation, if the record names no
/// deadline of its own.
pub const DEFAULT_MIGRATION_START_MS: Millis = 150_000;

impl Migration {
    /// How its stream travels, once the target listens.
    pub fn transport(&self) -> Option<MigrationTransport> {
        self.status
            .target_uri
            .as_deref()
            .and_then(MigrationTransport::of_uri)
    }

    /// The id of attempt `seq` of the VM named `vm` with uid `uid`.
    pub fn id_for(vm: &str, uid: &str, seq: u64) -> String {
        if uid.is_empty() {
            format!("{vm}-m{seq}")
        } else {
            format!("m{seq}-{uid}")
        }
    }

    /// Whether this migration was made for `vm` (this VM, not an earlier
    /// one of the same name) from its current instance: the only one it
    /// may hand over.
    pub fn is_from(&self, vm: &crate::VirtualMachine) -> bool {
        (self.vm_uid.is_empty() || self.vm_uid == vm.uid)
            && self.vm == vm.name
            && vm.status.instance.as_ref().map(|i| i.id.as_str())
                == Some(self.source_instance.as_str())
    }

    /// When it must have started sending, or be given up.
    pub fn start_deadline(&self) -> Millis {
        self.status
            .start_deadline
            .unwrap_or(self.created_at.saturating_add(DEFAULT_MIGRATION_START_MS))
    }

    /// When a migration sending since `started_at` is failed whatever its
    /// source says (a source that does not answer cannot be cancelled):
    /// the completion timeout for `memory_mib`, plus the progress timeout
    /// for a cancel made at the completion timeout to be reported.
    pub fn running_deadline_from(&self, started_at: Millis, memory_mib: u64) -> Millis {
        let t = &self.tuning;
        started_at
            .saturating_add(t.completion_timeout_ms(memory_mib))
            .saturating_add(t.progress_timeout_s.saturating_mul(1000))
    }

    /// The recorded running deadline; for a record from before it was
    /// recorded, the same rule from when it began sending.
    pub fn running_deadline(&self, memory_mib: u64) -> Millis {
        self.status.running_deadline.unwrap_or_else(|| {
            let started = self.status.started_at.unwrap_or(self.created_at);
            self.running_deadline_from(started, memory_mib)
        })
    }
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
pub enum MigrationPhase {
    /// Waiting for the target node to start an incoming instance.
    #[default]
    Pending,
    /// The target listens at `target_uri`.
    TargetReady,
    /// The source is sending its state.
    Running,
    Succeeded,
    Failed,
}

impl MigrationPhase {
    pub fn is_final(self) -> bool {
        matches!(self, MigrationPhase::Succeeded | MigrationPhase::Failed)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MigrationStatus {
    #[serde(default)]
    pub phase: MigrationPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_uri: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_ms: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Bytes sent at `progress_at`, the last time the sent amount was seen
    /// to grow (for the progress timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_at: Option<Millis>,
    /// The source's own figures at `progress_at`: the guest memory it
    /// sends, and what it still had to send then (for `--wait`'s progress
    /// line and its ETA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_total_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_remaining_bytes: Option<u64>,
    /// When the source node's agent saw the source instance gone before
    /// any outcome: not an outcome itself. The target settles it by its
    /// own state (paused with the whole state: Succeeded; exited: Failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_gone_at: Option<Millis>,
    /// A migration not sending by then is given up (the source's clock;
    /// see [`Migration::start_deadline`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_deadline: Option<Millis>,
    /// A migration still sending by then is failed, whatever its source
    /// says or fails to say (the source's clock; recorded when it begins
    /// sending, see [`Migration::running_deadline_from`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_deadline: Option<Millis>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_migration_id_of_the_longest_vm_name_is_valid() {
        let vm = "v".repeat(crate::name::MAX_VM_NAME_LEN);
        let id = Migration::id_for(&vm, &format!("{:016x}", u64::MAX), u64::MAX);
        crate::validate_name("instance", &id).unwrap();
    }

    #[test]
    fn defaults_are_bounded_and_the_timeout_scales_with_memory() {
        let t = MigrationTuning::default();
        assert_eq!(t.completion_timeout_per_gib_s, 150);
        assert_eq!(t.progress_timeout_s, 150);
        assert!(t.auto_converge);
        assert_eq!((t.parallel_per_cluster, t.parallel_per_node), (5, 2));
        assert_eq!(t.completion_timeout_ms(256), 150_000);
        assert_eq!(t.completion_timeout_ms(1024), 150_000);
        assert_eq!(t.completion_timeout_ms(1025), 300_000);
        assert_eq!(t.completion_timeout_ms(16 << 10), 16 * 150_000);
        t.validate().unwrap();
        let parsed: MigrationTuning = serde_json::from_str("{}").unwrap();
        assert_eq!(parsed, t);
        let bad = MigrationTuning {
            parallel_per_node: 0,
            ..t
        };
        assert_eq!(
            bad.validate().unwrap_err().field,
            "tuning.parallel_per_node"
        );
    }
}
