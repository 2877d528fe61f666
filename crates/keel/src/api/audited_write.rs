//! A request's one write and its audit event, as one store write: a VM
//! create used to cost the store two writes (the record, then the audit
//! event the door wrote after the answer).
//!
//! The door (`require_token`) runs each authenticated mutating request
//! inside a [`scope`] that knows who asks what from where; a handler
//! whose success is one store write makes it here, with the status it
//! answers on success, and the door then writes no audit event of its
//! own. Without a scope (an unaudited request), or if the write fails,
//! the door records the request as before, with its actual status.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::http::{Method, StatusCode};
use keel_api::Clock;
use keel_store::{Batch, Revision, StoreError, TypedStore};
use serde::Serialize;

use super::audit::audit_event;
use crate::token_book::Caller;

/// The request being audited, as the door saw it.
pub struct AuditedRequest {
    pub caller: Caller,
    pub method: Method,
    pub path: String,
    pub remote: String,
    pub clock: Arc<dyn Clock>,
    /// Set once a write has carried the request's audit event.
    recorded: AtomicBool,
}

impl AuditedRequest {
    pub fn new(
        caller: Caller,
        method: Method,
        path: String,
        remote: String,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            caller,
            method,
            path,
            remote,
            clock,
            recorded: AtomicBool::new(false),
        }
    }

    /// Whether a write already carried the audit event.
    pub fn recorded(&self) -> bool {
        self.recorded.load(Ordering::SeqCst)
    }
}

tokio::task_local! {
    static REQUEST: Arc<AuditedRequest>;
}

/// Runs `handler` (the rest of the request) with `request` known to the
/// writes it makes.
pub async fn scope<F: Future>(request: Arc<AuditedRequest>, handler: F) -> F::Output {
    REQUEST.scope(request, handler).await
}

/// Creates `key` with `value` and, in the same store write, the audit
/// event of the request being served, saying `status` (what the handler
/// answers once the create succeeds). A create outside an audited
/// request is a plain create.
pub async fn create<T: Serialize>(
    store: &TypedStore,
    key: &str,
    value: &T,
    status: StatusCode,
) -> Result<Revision, StoreError> {
    let Ok(request) = REQUEST.try_with(Arc::clone) else {
        return store.create(key, value).await;
    };
    let (audit_key, event) = audit_event(
        request.clock.now_ms(),
        &request.caller,
        &request.method,
        &request.path,
        &request.remote,
        status,
    );
    let batch = Batch::new().create(key, value).create(&audit_key, &event);
    match store.write_all(batch, None).await {
        Ok(revision) => {
            request.recorded.store(true, Ordering::SeqCst);
            Ok(revision)
        }
        // The audit key's random tail met another's: the record is
        // written alone and the door records the request as before.
        Err(StoreError::Conflict { key: taken, .. }) if taken == audit_key => {
            store.create(key, value).await
        }
        Err(err) => Err(err),
    }
}
