//! The API's door: every request but `/healthz` presents a bearer token
//! (`crate::token_book`), which must be live and of the role its route
//! needs (`roles::ROUTE_ROLES`), within its token's limits
//! (`token_limits`), before any handler runs. A refused request never
//! reaches a handler, so it changes nothing. Mutating requests that got
//! past authentication are written to the audit trail (`audit`) with
//! their outcome, refusals of role and limit included.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use keel_store::TypedStore;

use super::audited_write::{self, AuditedRequest};
use super::roles::{self, Access};
use super::token_limits::{ConsoleSession, TokenLimits, TokenMeters};
use crate::api::ApiError;
use crate::token_book::{Refusal, TokenBook};

/// What the door needs: the tokens, their meters, where audit goes.
#[derive(Clone)]
pub struct Door {
    pub book: Arc<TokenBook>,
    pub meters: Arc<TokenMeters>,
    pub store: TypedStore,
}

impl Door {
    pub fn new(book: Arc<TokenBook>, store: TypedStore, limits: TokenLimits) -> Self {
        let meters = Arc::new(TokenMeters::new(limits, book.clock().clone()));
        Self {
            book,
            meters,
            store,
        }
    }
}

/// The console session a request to attach holds; the console handler
/// takes it and keeps it for as long as the session lasts.
#[derive(Clone)]
pub struct ConsoleHold(Arc<Mutex<Option<ConsoleSession>>>);

impl ConsoleHold {
    pub fn take(&self) -> Option<ConsoleSession> {
        self.0.lock().expect("console hold").take()
    }
}

/// The bearer token of `Authorization: Bearer <token>`, if that is how
/// the request is authorised.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_at_checked(7)?;
    scheme
        .eq_ignore_ascii_case("bearer ")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

fn unauthorized(message: String) -> Response {
    let mut resp = ApiError::new(StatusCode::UNAUTHORIZED, message).into_response();
    resp.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"keel\""),
    );
    resp
}

/// Middleware: authentication, role, limits, audit.
pub async fn require_token(State(door): State<Door>, mut req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let needed = match roles::access_for(&method, &path) {
        Access::Open => return next.run(req).await,
        Access::Needs(role) => role,
    };
    // A browser's WebSocket cannot send the header: its token comes as a
    // subprotocol (`ws_auth`).
    let presented = bearer(req.headers())
        .or_else(|| super::ws_auth::subprotocol_token(&method, req.headers()))
        .unwrap_or_default();
    let caller = match door.book.authenticate(presented).await {
        Ok(caller) => caller,
        Err(Refusal::Unknown) => return unauthorized(
            "missing or invalid bearer token: send `Authorization: Bearer <token>` (the token is in DATA_DIR/token, or one made by `keel token create`)".into(),
        ),
        Err(Refusal::Refused(reason)) => {
            return unauthorized(format!("{reason}: ask an admin for a new one (`keel token create`)"))
        }
        Err(Refusal::Unavailable(err)) => {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cannot check the token: the store is unavailable ({err}); retry"),
            )
            .into_response()
        }
    };
    let remote = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or_else(|| "unknown".to_string(), |c| c.0.to_string());
    let refused = if !caller.role.includes(needed) {
        Some(
            ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "token {} has role {}; {method} {path} needs {needed}",
                    caller.name, caller.role
                ),
            )
            .with_field("role"),
        )
    } else {
        door.meters.admit(&caller.id).err()
    };
    // Whether the handler's own write carried the request's audit event.
    let (resp, audited) = match refused {
        Some(err) => (err.into_response(), false),
        None => {
            // The graphical console is a console session too.
            if method == Method::GET
                && (roles::matches("/api/v1/vms/{name}/console", &path)
                    || roles::matches("/api/v1/vms/{name}/vnc", &path))
            {
                match door.meters.open_console(&caller.id) {
                    Ok(session) => {
                        req.extensions_mut()
                            .insert(ConsoleHold(Arc::new(Mutex::new(Some(session)))));
                    }
                    Err(err) => return err.into_response(),
                }
            }
            req.extensions_mut().insert(caller.clone());
            req.extensions_mut().insert(door.book.clone());
            if roles::is_mutating(&method) {
                let request = Arc::new(AuditedRequest::new(
                    caller.clone(),
                    method.clone(),
                    path.clone(),
                    remote.clone(),
                    door.book.clock().clone(),
                ));
                let resp = audited_write::scope(request.clone(), next.run(req)).await;
                (resp, request.recorded())
            } else {
                (next.run(req).await, false)
            }
        }
    };
    if roles::is_mutating(&method) && !audited {
        let at = door.book.clock().now_ms();
        super::audit::record(
            &door.store,
            at,
            &caller,
            &method,
            &path,
            &remote,
            resp.status(),
        )
        .await;
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_parsing() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, "bearer  abc ".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        for bad in ["Basic abc", "Bearer ", "abc", "Bearerabc"] {
            h.insert(header::AUTHORIZATION, bad.parse().unwrap());
            assert_eq!(bearer(&h), None, "{bad}");
        }
    }
}
