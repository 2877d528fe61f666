//! The audit trail's writer: each mutating request made with a valid
//! token becomes an event under `/events/_audit/`, saying who (the
//! token's name), what (method and path), on which resource, from where,
//! and how it ended (the status). `keel events --actor NAME` lists them;
//! the event retention caps them (`keel serve --max-audit-events`).
//!
//! Written after the answer is made and before it is sent, so a client
//! that got its answer finds its request in the trail. A failed write is
//! logged, not answered: the request has happened by then.

use axum::http::{Method, StatusCode};
use keel_api::{Audit, AuditEvent, Event, Millis, Phase};
use keel_ctrl::keys::{AUDIT_EVENTS, EVENTS_PREFIX};
use keel_store::TypedStore;
use rand::RngCore;

use crate::token_book::Caller;

/// The resource a request acts on, `kind/name`, from its path:
/// `/api/v1/vms/web/snapshots/s1` is `snapshot/web/s1`.
pub fn resource_of(path: &str) -> String {
    let rest = path.strip_prefix("/api/v1/").unwrap_or(path);
    let parts: Vec<&str> = rest.split('/').filter(|p| !p.is_empty()).collect();
    match parts.as_slice() {
        ["vms", vm, "snapshots", snap, ..] => format!("snapshot/{vm}/{snap}"),
        ["vms", vm, ..] => format!("vm/{vm}"),
        ["nodes", node, ..] => format!("node/{node}"),
        ["images", image, ..] => format!("image/{image}"),
        ["tokens", id, ..] => format!("token/{id}"),
        [kind, ..] => kind.trim_end_matches('s').to_string(),
        [] => "api".to_string(),
    }
}

/// Where audit events are kept: ordered by time, unique by a random tail.
fn audit_key(at: Millis) -> String {
    let mut tail = [0u8; 4];
    rand::rngs::OsRng.fill_bytes(&mut tail);
    let tail: String = tail.iter().map(|b| format!("{b:02x}")).collect();
    format!("{EVENTS_PREFIX}{AUDIT_EVENTS}/{at:020}-{tail}")
}

/// Records one request; best effort (see the module's note).
pub async fn record(
    store: &TypedStore,
    at: Millis,
    caller: &Caller,
    method: &Method,
    path: &str,
    remote: &str,
    status: StatusCode,
) {
    let (key, event) = audit_event(at, caller, method, path, remote, status);
    if let Err(err) = store.create(&key, &event).await {
        tracing::warn!(actor = %caller.name, %method, path, %err, "could not record the audit event");
    }
}

/// The audit event of one request and the key it is kept under.
pub fn audit_event(
    at: Millis,
    caller: &Caller,
    method: &Method,
    path: &str,
    remote: &str,
    status: StatusCode,
) -> (String, AuditEvent) {
    let resource = resource_of(path);
    let vm = match resource.split_once('/') {
        Some(("vm" | "snapshot", rest)) => rest.split('/').next().unwrap_or(rest).to_string(),
        _ => String::new(),
    };
    let event = AuditEvent {
        event: Event {
            at,
            vm,
            from: Phase::default(),
            to: Phase::default(),
            reason: format!(
                "{method} {path} by {} from {remote}: {}",
                caller.name,
                status.as_u16()
            ),
            key: None,
        },
        audit: Audit {
            actor: caller.name.clone(),
            method: method.to_string(),
            path: path.to_string(),
            resource,
            remote: remote.to_string(),
            status: status.as_u16(),
        },
    };
    (audit_key(at), event)
}

#[cfg(test)]
mod tests {
    use super::resource_of;

    #[test]
    fn resources_are_named_by_kind() {
        assert_eq!(resource_of("/api/v1/vms/web/stop"), "vm/web");
        assert_eq!(resource_of("/api/v1/vms"), "vm");
        assert_eq!(
            resource_of("/api/v1/vms/web/snapshots/s1"),
            "snapshot/web/s1"
        );
        assert_eq!(resource_of("/api/v1/nodes/n1/drain"), "node/n1");
        assert_eq!(resource_of("/api/v1/tokens/abc"), "token/abc");
        assert_eq!(resource_of("/api/v1/tokens"), "token");
    }
}
