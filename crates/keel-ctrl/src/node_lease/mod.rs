//! The node lease, in one room: a node's heartbeat is its lease, and
//! everything that decides whether a node is alive, may act, or must end
//! its guests is here.
//!
//! - [`heartbeat`]: the agent's loop that writes the heartbeat and renews
//!   the local fence lease every [`HEARTBEAT_INTERVAL_MS`], bounded by the
//!   same interval, and self-fences when no heartbeat got through for
//!   `self_fence_ms` ([`Heartbeat::beat`]; production loops over it, the
//!   simulations call the same method on their virtual clock).
//! - [`agent_view`]: the agent's own view ([`NodeLease`]): how far each
//!   good heartbeat extends the fence lease, freezes for planned restarts,
//!   whether it may start anything, when it must fence itself.
//! - [`liveness`]: an observer's view (the leader, other agents): a node is
//!   silent for as long as this observer has seen its heartbeat unchanged;
//!   not ready after `node_ready_ms`, lost after `node_lease_ms`.
//! - [`name_claim`]: an agent starting under a node name another
//!   incarnation holds waits one full lease of that one's silence.
//! - [`own_record`]: the node's record as the agent last wrote it, so a
//!   heartbeat is one write, not a read and a write.
//!
//! The durations are `LifecycleConfig`'s `node_ready_ms` (15 s),
//! `self_fence_ms` (20 s) and `node_lease_ms` (40 s); every one is measured
//! on a clock that does not step ([`keel_api::Mono`]), the interval and the
//! heartbeat's bound are [`HEARTBEAT_INTERVAL_MS`]. The order that keeps one
//! instance per VM: a node's guests are fenced (`self_fence_ms` after its
//! last good heartbeat) well before anybody counts it lost (`node_lease_ms`
//! of silence), and only then are its VMs started elsewhere.

pub mod agent_view;
pub mod heartbeat;
pub mod liveness;
pub mod name_claim;
pub mod own_record;

pub use agent_view::{LeasePlan, NodeLease};
pub use heartbeat::{Heartbeat, LeaseHolder, HEARTBEAT_INTERVAL_MS};
