//! The audit trail: each mutating API request, who made it, on what, from
//! where and how it ended. Kept among the events (under
//! `/events/_audit/`), so the event history's bounds apply to it.

use serde::{Deserialize, Serialize};

use crate::Event;

/// One mutating API request as the audit trail records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Audit {
    /// The name of the token that made it.
    pub actor: String,
    pub method: String,
    pub path: String,
    /// The resource acted on, `kind/name` (`vm/web`, `node/n1`, ...).
    pub resource: String,
    /// The client's address as the server saw it.
    pub remote: String,
    /// The HTTP status of the answer.
    pub status: u16,
}

/// What is stored for an audited request: an [`Event`] (so every reader
/// of events lists it) with its [`Audit`] beside the event's fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditEvent {
    #[serde(flatten)]
    pub event: Event,
    pub audit: Audit,
}

/// Reads only the audit part of a stored event, if it has one.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct AuditPart {
    #[serde(default)]
    pub audit: Option<Audit>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Phase;

    #[test]
    fn an_audit_event_reads_as_an_event_and_keeps_its_audit() {
        let stored = AuditEvent {
            event: Event {
                at: 5,
                vm: "web".into(),
                from: Phase::default(),
                to: Phase::default(),
                reason: "POST /api/v1/vms/web/stop by ci: 200".into(),
                key: None,
            },
            audit: Audit {
                actor: "ci".into(),
                method: "POST".into(),
                path: "/api/v1/vms/web/stop".into(),
                resource: "vm/web".into(),
                remote: "127.0.0.1:4000".into(),
                status: 200,
            },
        };
        let bytes = serde_json::to_vec(&stored).unwrap();
        let event: Event = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(event, stored.event);
        let part: AuditPart = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(part.audit, Some(stored.audit));
        let plain = serde_json::to_vec(&stored.event).unwrap();
        assert!(serde_json::from_slice::<AuditPart>(&plain)
            .unwrap()
            .audit
            .is_none());
    }
}
