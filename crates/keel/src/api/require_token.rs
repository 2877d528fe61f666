//! The API's door: every request but `/healthz` presents the bearer token
//! (`crate::auth::Token`) before any handler runs.

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::api::ApiError;
use crate::auth::Token;

/// Middleware: everything but `/healthz` needs the bearer token. A refused
/// request never reaches a handler, so it changes nothing.
pub async fn require_token(State(token): State<Token>, req: Request, next: Next) -> Response {
    if req.uri().path() == "/healthz" || token.authorizes(req.headers()) {
        return next.run(req).await;
    }
    let mut resp = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "missing or invalid bearer token: send `Authorization: Bearer <token>` (the token is in DATA_DIR/token)",
    )
    .into_response();
    resp.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"keel\""),
    );
    resp
}
