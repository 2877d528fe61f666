//! The one write path of the API: read → modify → compare-and-swap, with
//! a bounded number of retries on a conflict with another writer, and the
//! client's own revision (`If-Match`, `?revision=`, a body `revision`)
//! checked exactly, never retried.

use std::time::Duration;

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_store::{Revision, StoreError};
use rand::Rng;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{ApiError, AppState};

/// Attempts of a read → modify → compare-and-swap before giving up with 503.
pub const MAX_ATTEMPTS: u32 = 16;

/// Read → modify → compare-and-swap of the record at `key` (`what` names
/// it in messages, e.g. `VM web`). Without `expected`, a conflict with
/// another writer (a controller, another client) is retried from a fresh
/// read, so no update is lost; with it, a changed record is a 409. A change
/// that leaves the record as it was is not written. `change` may run more
/// than once; an error from it ends the attempt and nothing is written.
pub async fn mutate<T>(
    state: &AppState,
    key: &str,
    what: &str,
    expected: Option<Revision>,
    not_found: impl Fn() -> ApiError,
    mut change: impl FnMut(&mut T) -> Result<(), ApiError>,
) -> Result<(T, Revision), ApiError>
where
    T: Serialize + DeserializeOwned + Clone + PartialEq,
{
    for attempt in 0..MAX_ATTEMPTS {
        let entry = state.store.get::<T>(key).await?.ok_or_else(&not_found)?;
        if let Some(expected) = expected {
            if entry.revision != expected {
                return Err(stale(what, expected, entry.revision));
            }
        }
        let mut value = entry.value.clone();
        change(&mut value)?;
        if value == entry.value {
            return Ok((value, entry.revision));
        }
        match state.store.update(key, &value, entry.revision).await {
            Ok(revision) => return Ok((value, revision)),
            Err(StoreError::Conflict { actual, .. }) => {
                if let Some(expected) = expected {
                    return Err(stale(what, expected, actual.unwrap_or(0)));
                }
                let jitter_ms = rand::thread_rng().gen_range(0..=(1u64 << attempt.min(6)));
                tokio::time::sleep(Duration::from_millis(jitter_ms)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("{what} kept changing during {MAX_ATTEMPTS} update attempts; try again"),
    ))
}

/// The revision a client says it read: `If-Match`, `?revision=` or a body
/// `revision` field. Several must agree. `If-Match: *` means "any".
pub fn expected_revision(
    headers: &HeaderMap,
    from_query: Option<Revision>,
    from_body: Option<Revision>,
) -> Result<Option<Revision>, ApiError> {
    let from_header = match headers.get(header::IF_MATCH) {
        None => None,
        Some(v) => {
            let text = v.to_str().unwrap_or("").trim();
            if text == "*" {
                None
            } else {
                let bare = text.strip_prefix("W/").unwrap_or(text).trim_matches('"');
                Some(bare.parse::<Revision>().map_err(|_| {
                    ApiError::bad_request(
                        "If-Match",
                        format!("If-Match {text:?} is not a revision (a number, as in the ETag)"),
                    )
                })?)
            }
        }
    };
    let mut found: Option<Revision> = None;
    for r in [from_header, from_query, from_body].into_iter().flatten() {
        match found {
            Some(f) if f != r => {
                return Err(ApiError::bad_request(
                    "revision",
                    format!("conflicting revisions given: {f} and {r}"),
                ))
            }
            _ => found = Some(r),
        }
    }
    Ok(found)
}

pub fn stale(what: &str, expected: Revision, actual: Revision) -> ApiError {
    ApiError::conflict(
        "revision",
        format!(
            "{what} changed since revision {expected} (now at {actual}); read it again and retry"
        ),
    )
}

/// A JSON response carrying the record's revision as `ETag` too.
pub fn with_etag<T: Serialize>(status: StatusCode, body: T, revision: Revision) -> Response {
    let mut resp = (status, Json(body)).into_response();
    resp.headers_mut().insert(
        header::ETAG,
        HeaderValue::from_str(&format!("\"{revision}\"")).expect("digits are a valid header"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn if_match_forms() {
        let mut h = HeaderMap::new();
        assert_eq!(expected_revision(&h, None, None).unwrap(), None);
        h.insert(header::IF_MATCH, "\"7\"".parse().unwrap());
        assert_eq!(expected_revision(&h, None, Some(7)).unwrap(), Some(7));
        assert_eq!(
            expected_revision(&h, Some(8), None).unwrap_err().field(),
            Some("revision")
        );
        h.insert(header::IF_MATCH, "W/\"9\"".parse().unwrap());
        assert_eq!(expected_revision(&h, None, None).unwrap(), Some(9));
        h.insert(header::IF_MATCH, "*".parse().unwrap());
        assert_eq!(expected_revision(&h, None, None).unwrap(), None);
        h.insert(header::IF_MATCH, "abc".parse().unwrap());
        assert_eq!(
            expected_revision(&h, None, None).unwrap_err().field(),
            Some("If-Match")
        );
    }
}
