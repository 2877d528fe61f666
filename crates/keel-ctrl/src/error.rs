//! The VM controller's errors, which the runtime reports too. Causes stay
//! in `source()`: print the chain (`error_chain`) to see all of it.

use keel_hv::HvError;
use keel_store::StoreError;

use crate::transitions::ForbiddenTransition;

/// The cause is in `source()`, never repeated in the message: print the
/// chain (`error_chain`) to see all of it.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("VM {vm}: store")]
    Store {
        vm: String,
        #[source]
        source: StoreError,
    },
    #[error("VM {vm}: hypervisor")]
    Hypervisor {
        vm: String,
        #[source]
        source: HvError,
    },
    /// A store read or write that a step's action needed (image records,
    /// the migration record): the store failed, not the hypervisor.
    #[error("VM {vm}: store, to {op}")]
    StoreForAction {
        vm: String,
        op: &'static str,
        #[source]
        source: StoreError,
    },
    #[error(transparent)]
    Forbidden(#[from] ForbiddenTransition),
}

#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Another agent claimed this node's name: this one must not renew its
    /// lease (its guests are fenced) or act for the node any more.
    #[error("node {node} is now run by another agent (incarnation {theirs}; this agent is {ours}); not renewing this agent's lease")]
    Superseded {
        node: String,
        theirs: String,
        ours: String,
    },
    /// The record was written, but the local fence lease could not be
    /// extended to match it.
    #[error("cannot extend the local fence lease")]
    Fence(#[source] HvError),
}

/// Why a step's action failed: the hypervisor, or the store holding a
/// record the action reads or creates. Never one reported as the other.
#[derive(Debug, thiserror::Error)]
pub enum ActError {
    #[error(transparent)]
    Hypervisor(#[from] HvError),
    #[error("{op}")]
    Store {
        op: &'static str,
        #[source]
        source: StoreError,
    },
}

impl ActError {
    pub(crate) fn for_vm(self, vm: &str) -> ReconcileError {
        let vm = vm.to_string();
        match self {
            ActError::Hypervisor(source) => ReconcileError::Hypervisor { vm, source },
            ActError::Store { op, source } => ReconcileError::StoreForAction { vm, op, source },
        }
    }
}
