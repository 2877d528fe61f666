//! `GET /api/v1/whoami`: the token the request was made with (its id,
//! name and role), never its secret. Any live token may ask: the web
//! console reads its role here to show only the actions the API would
//! let it take (the API refuses the others all the same).

use axum::{Extension, Json};
use keel_api::Role;
use serde::{Deserialize, Serialize};

use crate::token_book::Caller;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WhoAmI {
    pub id: String,
    pub name: String,
    pub role: Role,
}

pub async fn whoami(Extension(caller): Extension<Caller>) -> Json<WhoAmI> {
    Json(WhoAmI {
        id: caller.id,
        name: caller.name,
        role: caller.role,
    })
}

/// Adds the route to the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    doc["paths"]["/api/v1/whoami"] = serde_json::json!({"get": {
        "summary": "The token this request was made with: its id, name and role (never its secret); any live token may ask",
        "operationId": "whoami",
        "responses": {
            "200": {"description": "The caller", "content": {"application/json": {"schema": {
                "type": "object", "required": ["id", "name", "role"], "properties": {
                    "id": {"type": "string"},
                    "name": {"type": "string"},
                    "role": {"type": "string", "enum": ["viewer", "operator", "admin"]}
                }
            }}}},
            "401": {"description": "Missing or wrong bearer token", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        }
    }});
}
