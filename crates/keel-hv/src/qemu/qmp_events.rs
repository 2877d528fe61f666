//! Which of QEMU's monitor events are worth waking a controller for, and
//! as what [`DomainEventKind`]. The monitor's one QMP connection per
//! domain already receives every event (QEMU broadcasts them to each
//! client after capabilities negotiation): nothing extra is opened.
//!
//! `RESET` is not mapped here: the monitor counts it first (a reset of a
//! reset just counted is no reboot, `reset_count`) and sends
//! [`DomainEventKind::Reset`] only for a counted one.

use super::qmp::QmpEvent;
use crate::DomainEventKind;

/// The kind of domain event a QMP event announces; `None`: one the
/// controllers do not act on (`RTC_CHANGE`, `POWERDOWN`, the block job
/// events, …).
pub fn domain_event_kind(event: &QmpEvent) -> Option<DomainEventKind> {
    let text = |field: &str| {
        event
            .data
            .get(field)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    match event.event.as_str() {
        "SHUTDOWN" => Some(DomainEventKind::Shutdown {
            guest: event
                .data
                .get("guest")
                .and_then(|g| g.as_bool())
                .unwrap_or(false),
        }),
        "STOP" => Some(DomainEventKind::Stopped),
        "RESUME" => Some(DomainEventKind::Resumed),
        "GUEST_PANICKED" => Some(DomainEventKind::GuestPanicked),
        "BLOCK_IO_ERROR" => Some(DomainEventKind::BlockIoError {
            device: match text("node-name") {
                name if name.is_empty() => text("device"),
                name => name,
            },
        }),
        "MIGRATION" => Some(DomainEventKind::Migration {
            status: text("status"),
        }),
        "DEVICE_DELETED" => Some(DomainEventKind::DeviceDeleted {
            device: match text("device") {
                id if id.is_empty() => text("path"),
                id => id,
            },
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn event(name: &str, data: serde_json::Value) -> QmpEvent {
        QmpEvent {
            event: name.into(),
            data,
        }
    }

    #[test]
    fn the_lifecycle_events_map_to_their_kinds_and_others_to_none() {
        assert_eq!(
            domain_event_kind(&event(
                "SHUTDOWN",
                json!({"guest": true, "reason": "guest-shutdown"})
            )),
            Some(DomainEventKind::Shutdown { guest: true })
        );
        assert_eq!(
            domain_event_kind(&event("STOP", json!({}))),
            Some(DomainEventKind::Stopped)
        );
        assert_eq!(
            domain_event_kind(&event("RESUME", json!({}))),
            Some(DomainEventKind::Resumed)
        );
        assert_eq!(
            domain_event_kind(&event("GUEST_PANICKED", json!({"action": "pause"}))),
            Some(DomainEventKind::GuestPanicked)
        );
        assert_eq!(
            domain_event_kind(&event(
                "BLOCK_IO_ERROR",
                json!({"device": "", "node-name": "disk-data", "operation": "write"})
            )),
            Some(DomainEventKind::BlockIoError {
                device: "disk-data".into()
            })
        );
        assert_eq!(
            domain_event_kind(&event("MIGRATION", json!({"status": "completed"}))),
            Some(DomainEventKind::Migration {
                status: "completed".into()
            })
        );
        assert_eq!(
            domain_event_kind(&event(
                "DEVICE_DELETED",
                json!({"device": "hp-data", "path": "/machine/peripheral/hp-data"})
            )),
            Some(DomainEventKind::DeviceDeleted {
                device: "hp-data".into()
            })
        );
        assert_eq!(
            domain_event_kind(&event("RTC_CHANGE", json!({"offset": 1}))),
            None
        );
        // Counted by the monitor first, never mapped here.
        assert_eq!(
            domain_event_kind(&event("RESET", json!({"guest": true}))),
            None
        );
    }
}
