//! The one error shape of the API: `{"error": "...", "field": "..."}`,
//! `field` naming the offending input where there is one.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_api::ValidationError;
use keel_store::StoreError;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = Error)]
pub struct ErrorBody {
    pub error: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    status: StatusCode,
    body: ErrorBody,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            body: ErrorBody {
                error: message.into(),
                field: None,
            },
        }
    }

    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.body.field = Some(field.into());
        self
    }

    pub fn bad_request(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message).with_field(field)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// A well-formed request the current state refuses (policy, deletion in
    /// progress, stale revision, already exists).
    pub fn conflict(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message).with_field(field)
    }

    /// Well-formed JSON whose content is invalid.
    pub fn invalid(err: ValidationError) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, err.to_string()).with_field(err.field)
    }

    /// The state refuses the request (e.g. `request_stop` of an AlwaysOn VM).
    pub fn refused(err: ValidationError) -> Self {
        Self::new(StatusCode::CONFLICT, err.message).with_field(err.field)
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn field(&self) -> Option<&str> {
        self.body.field.as_deref()
    }

    pub fn message(&self) -> &str {
        &self.body.error
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.body.error, self.status)?;
        if let Some(field) = &self.body.field {
            write!(f, " [field {field}]")?;
        }
        Ok(())
    }
}

/// Store failures. A conflict reaching here was not retried, so it means the
/// client's revision is stale.
impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> Self {
        match &err {
            StoreError::Conflict { .. } => ApiError::conflict("revision", err.to_string()),
            StoreError::Unavailable { .. }
            | StoreError::Compacted { .. }
            | StoreError::GuardLost { .. } => {
                tracing::warn!(%err, "store unavailable");
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
            }
            StoreError::Corrupt { .. }
            | StoreError::LeaseNotFound { .. }
            | StoreError::InvalidWrite { .. } => {
                tracing::error!(%err, "store error");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, err.to_string())
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}
