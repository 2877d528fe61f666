//! `/api/v1/tokens`: list (`GET`), create (`POST`, the secret is in the
//! answer and nowhere else), revoke (`DELETE /api/v1/tokens/{id}`: the
//! record stays, marked revoked, so the audit trail's actor keeps its
//! meaning; refused everywhere as soon as the watch carries it). Admin
//! only (see `roles`).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use keel_api::{ApiToken, CreateTokenRequest, Millis, Role};
use keel_ctrl::keys::token_key;
use keel_store::StoreError;
use serde::{Deserialize, Serialize};

use super::extract::{JsonBody, NameParam, QueryParams};
use super::{ApiError, AppState};
use crate::token_book::{self, TokenBook};

/// A token as the API shows it: the record without its hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = Token)]
pub struct TokenView {
    pub id: String,
    pub name: String,
    pub role: Role,
    pub created: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked: Option<Millis>,
    /// `live`, `expired` or `revoked`, at the time of the answer.
    pub state: String,
}

impl TokenView {
    pub fn of(t: &ApiToken, now: Millis) -> Self {
        let state = match t.refusal(now) {
            None => "live",
            Some("token revoked") => "revoked",
            Some(_) => "expired",
        };
        Self {
            id: t.id.clone(),
            name: t.name.clone(),
            role: t.role,
            created: t.created,
            expires: t.expires,
            revoked: t.revoked,
            state: state.to_string(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenList {
    pub items: Vec<TokenView>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenResponse {
    pub token: TokenView,
}

/// The answer to a create: the only time the secret is shown.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreatedToken {
    pub token: TokenView,
    /// `keel_<id>_<secret>`, to send as `Authorization: Bearer <secret>`.
    pub secret: String,
}

pub async fn list(
    State(state): State<AppState>,
    Extension(book): Extension<Arc<TokenBook>>,
    query: QueryParams,
) -> Result<Json<TokenList>, ApiError> {
    query.finish()?;
    let now = state.clock.now_ms();
    let mut items: Vec<TokenView> = book
        .list()
        .await?
        .iter()
        .map(|t| TokenView::of(t, now))
        .collect();
    items.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));
    Ok(Json(TokenList { items }))
}

pub async fn create(
    State(state): State<AppState>,
    Extension(book): Extension<Arc<TokenBook>>,
    query: QueryParams,
    JsonBody(req): JsonBody<CreateTokenRequest>,
) -> Result<Response, ApiError> {
    query.finish()?;
    req.validate().map_err(ApiError::invalid)?;
    let now = state.clock.now_ms();
    // Names say who acted in the audit trail: one live token per name.
    // Checked before the create, so two racing creates of one name may
    // both pass; each still has its own id.
    if book
        .list()
        .await?
        .iter()
        .any(|t| t.name == req.name && t.is_live(now))
    {
        return Err(ApiError::conflict(
            "name",
            format!(
                "a live token named {} exists: revoke it first or pick another name",
                req.name
            ),
        ));
    }
    let expires = req.expires_in_s.map(|s| now.saturating_add(s * 1000));
    let minted = token_book::mint(&req.name, req.role, now, expires);
    match state
        .store
        .create(&token_key(&minted.record.id), &minted.record)
        .await
    {
        Ok(_) => {}
        Err(StoreError::Conflict { .. }) => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the new token's random id is taken; retry",
            ))
        }
        Err(err) => return Err(err.into()),
    }
    tracing::info!(token = %req.name, id = %minted.record.id, role = %req.role, "token created");
    let view = TokenView::of(&minted.record, now);
    book.remember(minted.record);
    Ok((
        StatusCode::CREATED,
        Json(CreatedToken {
            token: view,
            secret: minted.token,
        }),
    )
        .into_response())
}

/// Bounded retries of the read → revoke → compare-and-swap.
const REVOKE_ATTEMPTS: usize = 5;

pub async fn revoke(
    State(state): State<AppState>,
    Extension(book): Extension<Arc<TokenBook>>,
    NameParam(id): NameParam,
    query: QueryParams,
) -> Result<Json<TokenResponse>, ApiError> {
    query.finish()?;
    let key = token_key(&id);
    for _ in 0..REVOKE_ATTEMPTS {
        let entry = state
            .store
            .get::<ApiToken>(&key)
            .await?
            .ok_or_else(|| ApiError::not_found(format!("token {id} not found")))?;
        let now = state.clock.now_ms();
        if entry.value.revoked.is_some() {
            return Ok(Json(TokenResponse {
                token: TokenView::of(&entry.value, now),
            }));
        }
        let revoked = ApiToken {
            revoked: Some(now),
            ..entry.value
        };
        match state.store.update(&key, &revoked, entry.revision).await {
            Ok(_) => {
                tracing::info!(token = %revoked.name, %id, "token revoked");
                let view = TokenView::of(&revoked, now);
                book.remember(revoked);
                return Ok(Json(TokenResponse { token: view }));
            }
            Err(StoreError::Conflict { .. }) => continue,
            Err(err) => return Err(err.into()),
        }
    }
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("token {id} kept changing; retry"),
    ))
}

/// The token routes and types in the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    use serde_json::json;
    let error = |description: &str| json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let with = |mut ok: serde_json::Value, errs: &[(&str, &str)]| {
        for (code, why) in errs {
            ok[*code] = error(why);
        }
        ok
    };
    let common = [
        ("401", "Missing, wrong, expired or revoked bearer token"),
        ("403", "The token's role is not admin"),
        ("429", "The token's request rate limit"),
        ("503", "Store unavailable"),
    ];
    let view = |code: &str, description: &str| json!({code: {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TokenResponse"}}}}});
    let paths = json!({
        "/api/v1/tokens": {
            "get": {
                "summary": "List API tokens (never their secrets nor hashes); admin only", "operationId": "listTokens",
                "responses": with(json!({"200": {"description": "Tokens", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TokenList"}}}}}), &common)
            },
            "post": {
                "summary": "Create an API token; the answer holds its secret, the only time it is shown (the store keeps its SHA-256); admin only", "operationId": "createToken",
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CreateTokenRequest"}}}},
                "responses": with(json!({"201": {"description": "Created", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CreatedToken"}}}}}), &[common[0], common[1], common[2], ("400", "Malformed body"), ("409", "A live token of that name exists"), ("422", "Bad name or lifetime"), common[3]])
            }
        },
        "/api/v1/tokens/{id}": {"delete": {
            "summary": "Revoke a token: refused by every control plane from now on; the record stays, marked revoked; admin only", "operationId": "revokeToken",
            "parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}],
            "responses": with(view("200", "Revoked"), &[common[0], common[1], common[2], ("404", "No such token"), common[3]])
        }}
    });
    if let (Some(t), Some(a)) = (doc["paths"].as_object_mut(), paths.as_object()) {
        t.extend(a.clone());
    }
}
