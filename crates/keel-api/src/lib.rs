//! Keel's resource types: what is stored, what the API accepts, and the
//! validation that keeps bad input out of the store. Nothing here does I/O.

pub mod clock;
pub mod event;
pub mod migration;
pub mod name;
pub mod node;
pub mod snapshot;
pub mod validation;
pub mod vm;

pub use clock::{Clock, ManualClock, Millis, SystemClock};
pub use event::Event;
pub use migration::{Migration, MigrationPhase, MigrationStatus, MigrationTuning};
pub use name::{validate_name, validate_vm_name};
pub use node::{Accelerator, Drain, EvictionWindows, Node, NodeStatus};
pub use snapshot::{Snapshot, SnapshotPhase, SnapshotStatus};
pub use validation::ValidationError;
pub use vm::*;
