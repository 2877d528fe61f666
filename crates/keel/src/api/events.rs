//! `GET /api/v1/events[?vm=NAME][&follow=true]`: the recorded phase
//! changes, oldest first. With `follow`, newline-delimited JSON: the
//! recorded events, then each new one as the store's watch delivers it.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_api::Event;
use keel_ctrl::keys::EVENTS_PREFIX;
use keel_store::{Entry, Revision, WatchEvent};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::extract::QueryParams;
use super::paging::PageRequest;
use super::{ApiError, AppState};

pub const NDJSON: &str = "application/x-ndjson";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventItem {
    /// Store revision at which the event was recorded; orders events.
    pub revision: Revision,
    pub event: Event,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
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
    let prefix = match &vm {
        Some(vm) => format!("{EVENTS_PREFIX}{vm}/"),
        None => EVENTS_PREFIX.to_string(),
    };
    let (entries, revision) = state.store.raw().list(&prefix).await?;
    let mut items = entries
        .iter()
        .filter_map(decode)
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
        follow_events(state, prefix, revision, items, tx).await;
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
                    if let Some(item) = decode(&entry) {
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

fn decode(entry: &Entry) -> Option<EventItem> {
    match serde_json::from_slice::<Event>(&entry.value) {
        Ok(event) => Some(EventItem {
            revision: entry.mod_revision,
            event,
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
