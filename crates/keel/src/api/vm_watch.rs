//! `GET /api/v1/vms?watch=true`: the VM list as a stream of
//! newline-delimited JSON, fed by the store's watch: one `put` line per VM
//! as listed, a `synced` line, then a `put` line for each change of a VM
//! record and a `deleted` line for each record removed, in store order.
//! The web console's VM list and VM page live on it, so a page open in a
//! browser costs one stream, not one request per row and second.
//!
//! Each `put` carries `ready` as the server decides it
//! (`VirtualMachine::ready_since`), so a client never re-implements the
//! readiness rule. A broken watch ends the stream with an `error` line:
//! list again to resume.
//!
//! `&name=NAME` narrows the stream to that one VM (`keel … --wait`
//! follows it), so a client waiting on one VM is not sent every other.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use keel_api::VirtualMachine;
use keel_ctrl::keys::VMS_PREFIX;
use keel_store::{Entry, Revision, WatchEvent};
use serde::Serialize;
use tokio::sync::mpsc;

use super::events::NDJSON;
use super::{ApiError, AppState};

/// One line of the stream.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum VmWatchLine {
    /// A VM as stored at `revision` (listed, created or changed).
    Put {
        revision: Revision,
        ready: bool,
        vm: Box<VirtualMachine>,
    },
    /// Every VM that existed when the stream began has been sent.
    Synced { revision: Revision },
    /// The VM's record was removed at `revision`.
    Deleted { revision: Revision, name: String },
    /// The watch broke; nothing follows.
    Error { error: String },
}

impl VmWatchLine {
    fn put(revision: Revision, vm: VirtualMachine) -> Self {
        VmWatchLine::Put {
            revision,
            ready: vm.ready_since().is_some(),
            vm: Box::new(vm),
        }
    }

    fn to_bytes(&self) -> Bytes {
        let mut buf = serde_json::to_vec(self).expect("watch lines serialize");
        buf.push(b'\n');
        buf.into()
    }
}

/// The streamed response; takes one of the follow slots (`--max-follows`)
/// for as long as the client reads.
pub async fn stream(state: AppState, only: Option<String>) -> Result<Response, ApiError> {
    let slot = state.follows.acquire(state.limits.max_follows)?;
    // One VM's key is a prefix of its own and of every name that starts
    // like it: those are left out here and in `follow`.
    let prefix = match &only {
        Some(name) => format!("{VMS_PREFIX}{name}"),
        None => VMS_PREFIX.to_string(),
    };
    let (entries, revision) = state.store.list::<VirtualMachine>(&prefix).await?;
    let listed = entries
        .into_iter()
        .filter(|(_, e)| only.as_ref().is_none_or(|n| *n == e.value.name))
        .map(|(_, e)| VmWatchLine::put(e.revision, e.value))
        .collect::<Vec<_>>();
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        follow(state, &prefix, only.is_some(), revision, listed, tx).await;
        drop(slot);
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|line| (Ok::<_, Infallible>(line), rx))
    });
    let mut resp = Body::from_stream(body).into_response();
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(NDJSON));
    // A proxy must pass each line on as it comes, not gather the stream.
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(resp)
}

/// Feeds the stream until the client goes away, the server shuts down or
/// the watch breaks.
async fn follow(
    state: AppState,
    prefix: &str,
    exact: bool,
    listed_at: Revision,
    listed: Vec<VmWatchLine>,
    tx: mpsc::Sender<Bytes>,
) {
    for line in listed {
        if tx.send(line.to_bytes()).await.is_err() {
            return;
        }
    }
    let synced = VmWatchLine::Synced {
        revision: listed_at,
    };
    if tx.send(synced.to_bytes()).await.is_err() {
        return;
    }
    let mut shutdown = state.shutdown.clone();
    let mut watch = match state.store.raw().watch(prefix, listed_at + 1).await {
        Ok(w) => w,
        Err(err) => {
            let _ = tx.send(error_line(err.to_string())).await;
            return;
        }
    };
    loop {
        let line = tokio::select! {
            ev = watch.next() => match ev {
                Some(Ok(WatchEvent::Put(entry))) if exact && entry.key != prefix => continue,
                Some(Ok(WatchEvent::Deleted { key, .. })) if exact && key != prefix => continue,
                Some(Ok(WatchEvent::Put(entry))) => match decode(&entry) {
                    Some(vm) => VmWatchLine::put(entry.mod_revision, vm),
                    None => continue,
                },
                Some(Ok(WatchEvent::Deleted { key, revision })) => VmWatchLine::Deleted {
                    revision,
                    name: key.strip_prefix(VMS_PREFIX).unwrap_or(&key).to_string(),
                },
                Some(Err(err)) => {
                    let _ = tx.send(error_line(err.to_string())).await;
                    return;
                }
                None => return,
            },
            () = async { let _ = shutdown.wait_for(|stop| *stop).await; } => return,
            _ = tx.closed() => return,
        };
        if tx.send(line.to_bytes()).await.is_err() {
            return;
        }
    }
}

/// A record this build cannot read is left out of the stream, as a list
/// leaves it out (the store's typed list logs and counts it).
fn decode(entry: &Entry) -> Option<VirtualMachine> {
    serde_json::from_slice(&entry.value)
        .inspect_err(
            |err| tracing::warn!(key = %entry.key, %err, "VM watch: skipping undecodable record"),
        )
        .ok()
}

fn error_line(error: String) -> Bytes {
    VmWatchLine::Error { error }.to_bytes()
}

/// Adds `?watch=true` to the list's entry of the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    let list = &mut doc["paths"]["/api/v1/vms"]["get"];
    if let Some(params) = list["parameters"].as_array_mut() {
        params.push(serde_json::json!({
            "name": "watch", "in": "query", "required": false,
            "description": "Stream instead of a page (application/x-ndjson): a {\"type\":\"put\",\"revision\",\"ready\",\"vm\"} line per VM, {\"type\":\"synced\",\"revision\"}, then a put line per change and {\"type\":\"deleted\",\"revision\",\"name\"} per removal; {\"type\":\"error\",\"error\"} ends a broken stream (list again). Not with limit or continue.",
            "schema": {"type": "boolean"}
        }));
        params.push(serde_json::json!({
            "name": "name", "in": "query", "required": false,
            "description": "With watch=true only: stream this one VM (its put lines, synced, its deletion).",
            "schema": {"type": "string"}
        }));
    }
}
