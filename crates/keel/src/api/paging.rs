//! Pages of a list (`?limit=N&continue=TOKEN`, after Kubernetes): every
//! list answers at most [`DEFAULT_PAGE`] items unless asked for fewer or
//! more (at most [`MAX_PAGE`]), and a `continue` token when more follow.
//! The token is the sort key of the page's last item; the next page
//! starts after it, so an item created or deleted between pages moves
//! no other item to another page. Each page is read at its own revision.

use super::extract::QueryParams;
use super::ApiError;

pub const DEFAULT_PAGE: usize = 500;
pub const MAX_PAGE: usize = 5_000;

/// The OpenAPI `limit` and `continue` query parameters of a list.
pub fn openapi_parameters() -> [serde_json::Value; 2] {
    [
        serde_json::json!({
            "name": "limit", "in": "query", "required": false,
            "description": format!("Items per page (default {DEFAULT_PAGE})"),
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}
        }),
        serde_json::json!({
            "name": "continue", "in": "query", "required": false,
            "description": "The `continue` token of the previous page",
            "schema": {"type": "string"}
        }),
    ]
}

/// A list answer that comes in pages: what a client needs to follow them.
pub trait Paged {
    fn continue_token(&self) -> Option<&str>;
    /// Appends the items of the page that followed this one.
    fn append(&mut self, next: Self);
}

/// Implements [`Paged`] for a list with `revision`, `items` and
/// `continue_token`.
#[macro_export]
macro_rules! impl_paged {
    ($list:ty) => {
        impl $crate::api::paging::Paged for $list {
            fn continue_token(&self) -> Option<&str> {
                self.continue_token.as_deref()
            }
            fn append(&mut self, next: Self) {
                self.revision = next.revision;
                self.items.extend(next.items);
                self.continue_token = next.continue_token;
            }
        }
    };
}

/// What the client asked for: how many, and after which sort key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageRequest {
    pub limit: usize,
    pub after: Option<String>,
}

impl PageRequest {
    /// Takes `limit` and `continue` from the query; a `limit` that is not
    /// 1..=MAX_PAGE is a 400 naming it.
    pub fn take(query: &mut QueryParams) -> Result<Self, ApiError> {
        let limit = match query.take("limit")? {
            None => DEFAULT_PAGE,
            Some(v) => match v.parse::<usize>() {
                Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
                _ => {
                    return Err(ApiError::bad_request(
                        "limit",
                        format!("query parameter limit={v:?} must be a count from 1 to {MAX_PAGE}"),
                    ))
                }
            },
        };
        let after = query.take("continue")?.filter(|t| !t.is_empty());
        Ok(Self { limit, after })
    }

    /// Whether the request names a page at all (for endpoints where
    /// paging does not apply, such as a follow stream).
    pub fn is_default(&self) -> bool {
        self.limit == DEFAULT_PAGE && self.after.is_none()
    }

    /// The page of `items` (any order) after `self.after` by `key`, and
    /// the token of the next page if there is one.
    pub fn page<T, K: Ord>(
        &self,
        items: Vec<T>,
        key: impl Fn(&T) -> K,
        after: Option<K>,
        token: impl Fn(&K) -> String,
    ) -> (Vec<T>, Option<String>) {
        let mut items: Vec<(K, T)> = items
            .into_iter()
            .map(|t| (key(&t), t))
            .filter(|(k, _)| after.as_ref().is_none_or(|a| k > a))
            .collect();
        items.sort_by(|a, b| a.0.cmp(&b.0));
        let next = (items.len() > self.limit).then(|| token(&items[self.limit - 1].0));
        items.truncate(self.limit);
        (items.into_iter().map(|(_, t)| t).collect(), next)
    }

    /// [`Self::page`] by a name (VMs, images, snapshots): the token is the
    /// last name.
    pub fn page_by_name<T>(
        &self,
        items: Vec<T>,
        name: impl Fn(&T) -> &str,
    ) -> (Vec<T>, Option<String>) {
        self.page(
            items,
            |t| name(t).to_string(),
            self.after.clone(),
            String::clone,
        )
    }

    /// The `continue` token as a revision (events), a 400 naming it if it
    /// is not one.
    pub fn after_revision(&self) -> Result<Option<u64>, ApiError> {
        self.after
            .as_deref()
            .map(|t| {
                t.parse::<u64>().map_err(|_| {
                    ApiError::bad_request(
                        "continue",
                        format!("continue={t:?} is not a token this list gave"),
                    )
                })
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(limit: usize, after: Option<&str>) -> PageRequest {
        PageRequest {
            limit,
            after: after.map(String::from),
        }
    }

    #[test]
    fn pages_follow_each_other_without_gaps_or_repeats() {
        let names = vec!["c", "a", "e", "b", "d"];
        let (first, next) = req(2, None).page_by_name(names.clone(), |n| n);
        assert_eq!((first, next.as_deref()), (vec!["a", "b"], Some("b")));
        let (second, next) = req(2, next.as_deref()).page_by_name(names.clone(), |n| n);
        assert_eq!((second, next.as_deref()), (vec!["c", "d"], Some("d")));
        let (last, next) = req(2, next.as_deref()).page_by_name(names, |n| n);
        assert_eq!((last, next), (vec!["e"], None));
    }
}
