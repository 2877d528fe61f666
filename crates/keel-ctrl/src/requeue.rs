//! When a reconciler wants to look at a key again, and why: the runtime
//! names the why in the `reconcile` span of that next look.

use std::borrow::Cow;

use keel_api::Millis;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requeue {
    pub at: Millis,
    pub why: Cow<'static, str>,
}

impl Requeue {
    pub fn at(at: Millis, why: impl Into<Cow<'static, str>>) -> Self {
        Self {
            at,
            why: why.into(),
        }
    }
}
