//! The memory balloon device (`virtio-balloon-pci`, id `balloon0`) and
//! the guest's view of its memory that it carries: the guest's balloon
//! driver reports its kernel's figures (total, free, available) every
//! polling interval, and QEMU keeps the last report as the device's
//! `guest-stats` property.
//!
//! Only instances launched with it have it (`DomainSpec::balloon`): the
//! device is part of what a live migration's target must match.

use std::time::Duration;

use serde_json::{json, Value};

use super::QmpClient;
use crate::vm_stats::GuestMemory;

/// The device's QOM path (its `id`).
const DEVICE_PATH: &str = "/machine/peripheral/balloon0";
/// How often the guest is asked to report, in seconds: QEMU's default is
/// never.
pub const POLLING_INTERVAL_SECONDS: u64 = 10;

/// The device's command-line arguments. Free page reporting stays off: it
/// hands freed guest pages back to the host, which changes the guest's
/// memory behind its QEMU's RSS and is not asked for.
pub fn device_args() -> [String; 2] {
    [
        "-device".to_string(),
        "virtio-balloon-pci,id=balloon0,free-page-reporting=off".to_string(),
    ]
}

/// The guest's last report, within `bound` per QMP command. `Ok(None)`:
/// the guest has not reported (no driver, or still booting). `Err`: no
/// balloon device, or QMP failed.
///
/// Polling is asked for at every read: the guest's driver sends one report
/// when it loads and then only when polled, polling is off at every start
/// (a migration's target included), and setting the interval QEMU already
/// has only stores it again, so asking each time is the simple way to keep
/// the figures fresh wherever the instance came from.
pub async fn guest_memory(qmp: &QmpClient, bound: Duration) -> Result<Option<GuestMemory>, String> {
    qmp.execute_within(
        "qom-set",
        Some(json!({
            "path": DEVICE_PATH,
            "property": "guest-stats-polling-interval",
            "value": POLLING_INTERVAL_SECONDS,
        })),
        bound,
    )
    .await
    .map_err(|e| e.to_string())?;
    let stats = qmp
        .execute_within(
            "qom-get",
            Some(json!({"path": DEVICE_PATH, "property": "guest-stats"})),
            bound,
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(from_report(&stats))
}

/// The figures of a `guest-stats` value; `None` before the first report
/// (`last-update` 0) or when it names none of them.
fn from_report(stats: &Value) -> Option<GuestMemory> {
    let reported_at = stats["last-update"].as_u64().filter(|t| *t != 0)?;
    // A figure the guest did not report is -1 (as an unsigned 64-bit
    // number, its maximum).
    let figure = |name: &str| stats["stats"][name].as_u64().filter(|n| *n != u64::MAX);
    let memory = GuestMemory {
        total_bytes: figure("stat-total-memory"),
        free_bytes: figure("stat-free-memory"),
        available_bytes: figure("stat-available-memory"),
        reported_at: None,
    };
    (memory != GuestMemory::default()).then_some(GuestMemory {
        reported_at: Some(reported_at),
        ..memory
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_gives_the_figures_the_guest_sent() {
        let report = json!({"last-update": 1733390000, "stats": {
            "stat-total-memory": 250_000_000u64,
            "stat-free-memory": 200_000_000u64,
            "stat-available-memory": u64::MAX,
            "stat-swap-in": 0,
        }});
        assert_eq!(
            from_report(&report),
            Some(GuestMemory {
                total_bytes: Some(250_000_000),
                free_bytes: Some(200_000_000),
                available_bytes: None,
                reported_at: Some(1733390000),
            })
        );
    }

    #[test]
    fn no_report_yet_gives_none() {
        let before = json!({"last-update": 0, "stats": {
            "stat-total-memory": u64::MAX, "stat-free-memory": u64::MAX,
        }});
        assert_eq!(from_report(&before), None);
        let nothing_known = json!({"last-update": 5, "stats": {"stat-total-memory": u64::MAX}});
        assert_eq!(from_report(&nothing_known), None);
    }

    #[test]
    fn the_device_has_its_id_and_no_free_page_reporting() {
        let args = device_args();
        assert_eq!(args[0], "-device");
        assert!(args[1].starts_with("virtio-balloon-pci,"), "{args:?}");
        assert!(args[1].contains("id=balloon0"), "{args:?}");
        assert!(args[1].contains("free-page-reporting=off"), "{args:?}");
    }
}
