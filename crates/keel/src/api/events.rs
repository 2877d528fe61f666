//! `GET /api/v1/events[?vm=NAME][&actor=TOKEN][&follow=true]`: the
//! recorded phase changes and the audit trail (`actor`: only the requests
//! made with the token of that name), oldest first. With `follow`, newline-delimited JSON: the
//! recorded events, then each new one as the store's watch delivers it.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_api::{Audit, AuditPart, Event};
use keel_ctrl::keys::{AUDIT_EVENTS, EVENTS_PREFIX};
use keel_store::{Entry, Revision, WatchEvent};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::extract::QueryParams;
use super::paging::PageRequest;
use super::{ApiError, AppState};

pub const NDJSON: &str = "application/x-ndjson";

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EventItem {
    /// Store revision at which the event was recorded; orders events.
    pub revision: Revision,
    pub event: Event,
    /// Set on the audit trail's events: who made which request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<Audit>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EventList {
    pub revision: Revision,
    pub items: Vec<EventItem>,
    /// Present when more items follow: pass it as `?continue=` for the next page.
    #[serde(rename = "continue", default, skip_serializing_if = "Option::is_none")]
    pub continue_token: Option<String>,
}

crate::impl_paged!(EventList);

pub async fn list(
    State(state): State<AppState>,
    mut query: QueryParams,
) -> Result<Response, ApiError> {
    let vm = query.take_name("vm")?;
    let actor = query.take_name("actor")?;
    let follow = query.take_bool("follow")?.unwrap_or(false);
    let page = PageRequest::take(&mut query)?;
    query.finish()?;
    if follow && !page.is_default() {
        return Err(ApiError::bad_request(
            "limit",
            "limit and continue page a list; follow streams every recorded event, then each new one",
        ));
    }
    let after = page.after_revision()?;
    let prefix = match (&vm, &actor) {
        // The audit trail is kept apart; `vm` then picks its requests
        // about that VM.
        (_, Some(_)) => format!("{EVENTS_PREFIX}{AUDIT_EVENTS}/"),
        (Some(vm), None) => format!("{EVENTS_PREFIX}{vm}/"),
        (None, None) => EVENTS_PREFIX.to_string(),
    };
    let filter = Filter { vm, actor };
    let (entries, revision) = state.store.raw().list(&prefix).await?;
    let mut items = entries
        .iter()
        .filter_map(decode)
        .filter(|i| filter.admits(i))
        .collect::<Vec<EventItem>>();
    if !follow {
        let (items, continue_token) = page.page(items, |i| i.revision, after, u64::to_string);
        return Ok(Json(EventList {
            revision,
            items,
            continue_token,
        })
        .into_response());
    }
    items.sort_by_key(|i| i.revision);

    let slot = state.follows.acquire(state.limits.max_follows)?;
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        follow_events(state, prefix, filter, revision, items, tx).await;
        drop(slot);
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|line| (Ok::<_, Infallible>(line), rx))
    });
    let mut resp = Body::from_stream(stream).into_response();
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(NDJSON));
    Ok(resp)
}

/// Feeds the stream until the client goes away, the server shuts down or
/// the watch breaks (then a final `{"error": ...}` line: re-list to resume).
async fn follow_events(
    state: AppState,
    prefix: String,
    filter: Filter,
    listed_at: Revision,
    existing: Vec<EventItem>,
    tx: mpsc::Sender<Bytes>,
) {
    for item in existing {
        if tx.send(line(&item)).await.is_err() {
            return;
        }
    }
    let mut shutdown = state.shutdown.clone();
    let mut watch = match state.store.raw().watch(&prefix, listed_at + 1).await {
        Ok(w) => w,
        Err(err) => {
            let _ = tx.send(error_line(&err.to_string())).await;
            return;
        }
    };
    loop {
        tokio::select! {
            ev = watch.next() => match ev {
                Some(Ok(WatchEvent::Put(entry))) => {
                    if let Some(item) = decode(&entry).filter(|i| filter.admits(i)) {
                        if tx.send(line(&item)).await.is_err() {
                            return;
                        }
                    }
                }
                Some(Ok(WatchEvent::Deleted { .. })) => {}
                Some(Err(err)) => {
                    let _ = tx.send(error_line(&err.to_string())).await;
                    return;
                }
                None => return,
            },
            () = async { let _ = shutdown.wait_for(|stop| *stop).await; } => return,
            _ = tx.closed() => return,
        }
    }
}

/// What `?vm=` and `?actor=` ask for, once the prefix is listed.
struct Filter {
    vm: Option<String>,
    actor: Option<String>,
}

impl Filter {
    fn admits(&self, item: &EventItem) -> bool {
        let Some(actor) = &self.actor else {
            return true;
        };
        item.audit.as_ref().is_some_and(|a| &a.actor == actor)
            && self.vm.as_ref().is_none_or(|vm| &item.event.vm == vm)
    }
}

fn decode(entry: &Entry) -> Option<EventItem> {
    match serde_json::from_slice::<Event>(&entry.value) {
        Ok(event) => Some(EventItem {
            revision: entry.mod_revision,
            event,
            audit: serde_json::from_slice::<AuditPart>(&entry.value)
                .ok()
                .and_then(|p| p.audit),
        }),
        Err(err) => {
            tracing::warn!(key = %entry.key, %err, "skipping undecodable event");
            None
        }
    }
}

fn line(item: &EventItem) -> Bytes {
    let mut buf = serde_json::to_vec(item).expect("events serialize");
    buf.push(b'\n');
    buf.into()
}

fn error_line(message: &str) -> Bytes {
    let mut buf =
        serde_json::to_vec(&serde_json::json!({ "error": message })).expect("json serializes");
    buf.push(b'\n');
    buf.into()
}
