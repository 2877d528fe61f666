//! Whether a guest may keep running while its memory is sent.
//!
//! Live pre-copy relies on QEMU's dirty tracking: every guest write after a
//! page was sent marks it for sending again. Under TCG before QEMU 9.0 that
//! tracking loses writes. The fast path of
//! `cpu_physical_memory_sync_dirty_bitmap` clears 64 pages' dirty bits at a
//! time without resetting the TCG TLB entries of those pages, so a vCPU
//! keeps storing through entries that no longer mark anything dirty (QEMU
//! commit 03bfc2188f, "physmem: Fix migration dirty bitmap coherency with
//! TCG memory access", first in 9.0). The pages hit are the hottest ones,
//! per-CPU data above all: on the target the Debian guest's kernel found a
//! corrupted `preempt_count` or timer list within a second, in 2 of 7
//! drains under QEMU 7.2.
//!
//! On such a node Keel pauses the source before `migrate`, so every page is
//! sent once with no vCPU running and nothing can be lost: the migration is
//! not live (the guest stands still for the whole transfer, seconds under
//! TCG), but it arrives as it left. KVM keeps its own dirty log in the host
//! kernel and migrates live, as does TCG from QEMU 9.0 on.

use keel_api::Accelerator;
use serde::Deserialize;
use serde_json::Value;

use super::super::qmp::{QmpClient, QmpError};

/// `query-version`'s `qemu` part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
pub struct QemuVersion {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
}

/// The first QEMU whose TCG dirty tracking keeps every write.
pub const TCG_DIRTY_TRACKING_FIXED: QemuVersion = QemuVersion {
    major: 9,
    minor: 0,
    micro: 0,
};

/// How the source sends its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precopy {
    /// The guest runs on while its memory is sent; written pages are sent
    /// again.
    Live,
    /// The guest is paused before the first page is sent.
    SourcePaused,
}

/// Pure: the pre-copy mode for a source under `accelerator` in `qemu`.
pub fn precopy_for(accelerator: Accelerator, qemu: QemuVersion) -> Precopy {
    match accelerator {
        Accelerator::Kvm => Precopy::Live,
        Accelerator::Tcg | Accelerator::Sim if qemu < TCG_DIRTY_TRACKING_FIXED => {
            Precopy::SourcePaused
        }
        Accelerator::Tcg | Accelerator::Sim => Precopy::Live,
    }
}

pub async fn query_version(client: &QmpClient) -> Result<QemuVersion, QmpError> {
    let value = client.execute("query-version", None).await?;
    let qemu = value.get("qemu").cloned().unwrap_or(Value::Null);
    serde_json::from_value(qemu)
        .map_err(|e| QmpError::Protocol(format!("query-version result: {e}")))
}

/// Whether a source Keel paused for its migration may be resumed, from
/// QEMU's run state and the migration's stage: only once the migration is
/// known not to have handed over (failed or cancelled, or never started),
/// never after `completed`, when the target owns the guest.
pub fn may_resume(status: &str, stage: &super::Stage) -> bool {
    use super::Stage;
    match stage {
        // A migration that failed in its final phase leaves `postmigrate`.
        Stage::Failed(_) => matches!(status, "paused" | "postmigrate"),
        // `migrate` never sent (or refused): still our plain pause.
        Stage::Idle => status == "paused",
        Stage::Active | Stage::Completed => false,
    }
}

#[cfg(test)]
mod tests {
    use super::super::Stage;
    use super::*;

    fn v(major: u32, minor: u32, micro: u32) -> QemuVersion {
        QemuVersion {
            major,
            minor,
            micro,
        }
    }

    #[test]
    fn tcg_before_qemu_9_pauses_the_source() {
        assert_eq!(
            precopy_for(Accelerator::Tcg, v(7, 2, 22)),
            Precopy::SourcePaused
        );
        assert_eq!(
            precopy_for(Accelerator::Tcg, v(8, 2, 99)),
            Precopy::SourcePaused
        );
        assert_eq!(precopy_for(Accelerator::Tcg, v(9, 0, 0)), Precopy::Live);
        assert_eq!(precopy_for(Accelerator::Tcg, v(10, 0, 2)), Precopy::Live);
        assert_eq!(precopy_for(Accelerator::Kvm, v(7, 2, 22)), Precopy::Live);
    }

    #[test]
    fn a_paused_source_is_resumed_only_when_it_did_not_hand_over() {
        let failed = Stage::Failed("cancelled".into());
        assert!(may_resume("paused", &failed));
        assert!(may_resume("postmigrate", &failed));
        assert!(may_resume("paused", &Stage::Idle));
        assert!(!may_resume("postmigrate", &Stage::Idle));
        assert!(!may_resume("postmigrate", &Stage::Completed));
        assert!(!may_resume("paused", &Stage::Active));
        assert!(!may_resume("running", &failed));
    }

    #[test]
    fn the_version_comes_from_query_version() {
        let reply = serde_json::json!({
            "qemu": {"micro": 22, "minor": 2, "major": 7},
            "package": "Debian 1:7.2+dfsg-7+deb12u18+b3"
        });
        let qemu: QemuVersion = serde_json::from_value(reply["qemu"].clone()).unwrap();
        assert_eq!(qemu, v(7, 2, 22));
    }
}
