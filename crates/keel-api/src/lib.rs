//! Keel's resource types: what is stored, what the API accepts, and the
//! validation that keeps bad input out of the store. Nothing here does I/O.

// Production code handles its errors; `unwrap` is for tests (which
// compile this crate with cfg(test)), `expect` states an invariant.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod api_token;
pub mod audit;
pub mod capacity;
pub mod cdrom;
pub mod clock;
pub mod clone;
pub mod clone_source;
pub mod cloud_init;
pub mod disk_change;
pub mod disk_record;
pub mod drain_return;
pub mod drained_from;
pub mod event;
pub mod graphics;
pub mod hardware;
pub mod hotplug;
pub mod image;
pub mod migration;
pub mod name;
pub mod network;
pub mod node;
pub mod placement;
pub mod readiness;
pub mod reboot;
pub mod snapshot;
pub mod started_with;
pub mod tpm;
mod transitions;
pub mod untrusted;
pub mod user_migration;
pub mod validation;
pub mod vm;
pub mod vm_export;

pub use api_token::{ApiToken, CreateTokenRequest, Role};
pub use audit::{Audit, AuditEvent, AuditPart};
pub use capacity::{CapacityPolicy, Demand, HostResources, NodeCapacity};
pub use cdrom::BootDevice;
pub use clock::{Clock, ManualClock, Millis, Mono, SystemClock};
pub use clone_source::CloneSource;
pub use cloud_init::CloudInitSpec;
pub use disk_change::DiskChangeError;
pub use disk_record::{DiskHome, DiskRecord};
pub use drained_from::DrainedFrom;
pub use event::Event;
pub use graphics::Graphics;
pub use hardware::{HostHardware, VmHardware};
pub use hotplug::{PluggedDisk, HOTPLUG_PORTS};
pub use image::{Image, ImageFormat, ImageKind};
pub use migration::{
    Migration, MigrationEndpoint, MigrationPhase, MigrationStatus, MigrationTransport,
    MigrationTuning,
};
pub use name::{validate_name, validate_vm_name, MAX_NAME_LEN};
pub use network::{MacAddr, NetworkMode, NetworkSpec, PortForward, Protocol};
pub use node::{Accelerator, Drain, EvictionWindows, Node, NodeFreeze, NodeStatus, MAX_FREEZE_MS};
pub use placement::{AntiAffinity, Labels, PlacementRules};
pub use readiness::{GuestAddress, InstanceReadiness, Readiness};
pub use reboot::RebootProgress;
pub use snapshot::{Snapshot, SnapshotPhase, SnapshotStatus};
pub use started_with::StartedWith;
pub use tpm::{TpmSpec, TpmVersion};
pub use user_migration::{MigrateOutcome, MigrateRequest};
pub use validation::ValidationError;
pub use vm::*;
pub use vm_export::{ExportManifest, ExportedFile};

/// The version of the stored record format this build writes, in each
/// record's top-level [`SCHEMA_VERSION_FIELD`]. Records are read leniently:
/// a field this build does not know (written by a newer Keel during a
/// rolling upgrade, say) is ignored, and a missing version means a record
/// written before versioning (0). The API stays strict: request bodies are
/// parsed into their own types, which refuse unknown fields.
pub const SCHEMA_VERSION: u32 = 1;

/// The field every stored record carries [`SCHEMA_VERSION`] in.
pub const SCHEMA_VERSION_FIELD: &str = "schema_version";
