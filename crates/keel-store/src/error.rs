use crate::{LeaseId, Revision};

/// Every variant names the key (or lease) it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("conflict on {key}: expected revision {expected:?}, found {actual:?}")]
    Conflict {
        key: String,
        /// `None` means the writer expected the key to be absent.
        expected: Option<Revision>,
        /// `None` means the key does not exist.
        actual: Option<Revision>,
    },
    #[error("watch of {prefix} from revision {from}: history compacted up to {compacted}")]
    Compacted {
        prefix: String,
        from: Revision,
        compacted: Revision,
    },
    #[error("lease {lease} not found or expired")]
    LeaseNotFound { lease: LeaseId },
    #[error("store unavailable while accessing {key}: {reason}")]
    Unavailable { key: String, reason: String },
    /// A guarded write found its guard key gone or re-created: the writer
    /// no longer holds what the guard stood for (say, leadership), and the
    /// write was not applied.
    #[error(
        "guard {guard} lost: the key is gone or was re-created by another writer; nothing written"
    )]
    GuardLost { guard: String },
    /// An atomic write was malformed (empty, or a key named twice); a
    /// caller's mistake, nothing was written.
    #[error("invalid atomic write at {key}: {reason}")]
    InvalidWrite { key: String, reason: String },
    #[error("stored value at {key} is corrupt: {reason}")]
    Corrupt { key: String, reason: String },
}
