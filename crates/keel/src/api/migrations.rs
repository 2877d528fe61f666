//! `GET /api/v1/migrations[?vm=NAME]`: live migration attempts (made by
//! node drains and `keel vm migrate`), oldest first. Read-only: the controllers write them.

use axum::extract::State;
use axum::Json;
use keel_api::Migration;
use keel_ctrl::keys::{migrations_of_prefix, MIGRATIONS_PREFIX};
use keel_store::Revision;
use serde::{Deserialize, Serialize};

use super::extract::QueryParams;
use super::{ApiError, AppState};

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MigrationItem {
    pub revision: Revision,
    pub migration: Migration,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MigrationList {
    /// The store revision the list is consistent with.
    pub revision: Revision,
    pub items: Vec<MigrationItem>,
}

pub async fn list(
    State(state): State<AppState>,
    mut query: QueryParams,
) -> Result<Json<MigrationList>, ApiError> {
    let vm = query.take_name("vm")?;
    query.finish()?;
    let prefix = match &vm {
        Some(vm) => migrations_of_prefix(vm),
        None => MIGRATIONS_PREFIX.to_string(),
    };
    let (entries, revision) = state.store.list::<Migration>(&prefix).await?;
    let mut items: Vec<MigrationItem> = entries
        .into_iter()
        .map(|(_, e)| MigrationItem {
            revision: e.revision,
            migration: e.value,
        })
        .collect();
    // Keys sort `web-m10` before `web-m2`; creation time does not.
    items.sort_by(|a, b| {
        let (a, b) = (&a.migration, &b.migration);
        (a.created_at, &a.vm, &a.id).cmp(&(b.created_at, &b.vm, &b.id))
    });
    Ok(Json(MigrationList { revision, items }))
}
