//! Keel's reconcilers. Each is a level-triggered state machine: it reads the
//! stored record and what the node reports, decides the next step with a
//! pure function (`*_decide` modules), and applies it. Time comes from an
//! injected [`keel_api::Clock`], so tests move time instead of sleeping.

// Production code handles its errors; `unwrap` is for tests (which
// compile this crate with cfg(test)), `expect` states an invariant.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod cluster_controller;
pub mod config;
mod domain_spec;
mod drain_wake;
pub mod election;
pub mod error;
mod error_chain;
pub mod event_retention;
mod events;
pub mod evict_decide;
pub mod fence;
mod handover;
pub mod hardware;
pub mod hot_unplug;
pub mod hotplug;
pub mod images;
mod joined_step;
pub mod keys;
pub mod migration_controller;
mod migration_decide;
pub mod node_concern;
pub mod node_lease;
pub mod observe;
pub mod online_resize;
mod own_records;
pub mod placement_rules;
pub mod readiness;
pub mod reboot;
mod recorded_write;
pub mod requeue;
pub mod restart_required;
pub mod resync;
pub mod runtime;
pub mod schedule;
pub mod snapshot_controller;
pub mod step;
mod stop;
pub mod tpm_state;
pub mod transitions;
mod user_migrate_decide;
pub mod view;
pub mod vm_controller;
pub mod vm_decide;
pub mod vm_decodes;
pub mod vm_index;
pub mod vm_next_look;

pub use cluster_controller::{run_control_plane, ClusterController, PassReport};
pub use config::LifecycleConfig;
pub use election::{ElectionConfig, LeaderElection, LeaderRecord};
pub use error_chain::error_chain;
pub use evict_decide::{migrations_to_collect, KEEP_FINAL_MIGRATIONS};
pub use fence::Fence;
pub use migration_controller::MigrationController;
pub use observe::{LifecycleObserver, NoObserver};
pub use runtime::{run_controllers, run_vm_controller, Reconciler, Runtime, RuntimeConfig};
pub use runtime::{run_vm_controller_with, DEFAULT_MAX_CONCURRENT_RECONCILES};
pub use runtime::{RunningControllers, StopError};
pub use snapshot_controller::{SnapshotController, SnapshotError};
pub use step::{HvAction, Step};
pub use view::{ClusterView, Observed, RestoreSource};
pub use vm_controller::{ActError, ReconcileError, VmController};
pub use vm_decide::decide;
