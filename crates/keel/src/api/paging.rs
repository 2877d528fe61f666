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
    /// the token of the next page if there is one. Items with equal keys
    /// are never split across pages (the page grows past the limit
    /// instead): events of one atomic write share their revision, and
    /// the next page starts after it.
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
        let mut end = self.limit.min(items.len());
        while end > 0 && end < items.len() && items[end].0 == items[end - 1].0 {
            end += 1;
        }
        let next = (items.len() > end).then(|| token(&items[end - 1].0));
        items.truncate(end);
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

    /// Events of one atomic write share a revision: a page that would end
    /// among them takes them all, so the next page (after that revision)
    /// loses none.
    #[test]
    fn items_with_one_key_stay_on_one_page() {
        let events = vec![(5, "a"), (7, "b"), (7, "c"), (7, "d"), (9, "e")];
        let page = |after: Option<u64>| {
            req(2, after.map(|a| a.to_string()).as_deref()).page(
                events.clone(),
                |e| e.0,
                after,
                u64::to_string,
            )
        };
        let (first, next) = page(None);
        assert_eq!(first, [(5, "a"), (7, "b"), (7, "c"), (7, "d")]);
        assert_eq!(next.as_deref(), Some("7"));
        let (second, next) = page(Some(7));
        assert_eq!((second, next), (vec![(9, "e")], None));
    }
}
