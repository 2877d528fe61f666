//! Keeps what each `reconcile` span opened by the runtime says (kind, key,
//! why), so a test can tell why a look ran. The layer is set as the
//! thread's default subscriber; the simulations run on one thread.

// The runtime's unit test and the integration tests each use a part.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer};

#[derive(Clone, Default)]
pub struct ReconcileSpans(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> Layer<S> for ReconcileSpans {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: Context<'_, S>,
    ) {
        struct Fields(Vec<String>);
        impl Visit for Fields {
            fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
                self.0.push(format!("{}={value:?}", field.name()));
            }
            fn record_str(&mut self, field: &Field, value: &str) {
                self.0.push(format!("{}={value}", field.name()));
            }
        }
        if attrs.metadata().name() == "reconcile" {
            let mut fields = Fields(Vec::new());
            attrs.record(&mut fields);
            self.0.lock().unwrap().push(fields.0.join(" "));
        }
    }
}

impl ReconcileSpans {
    /// Forgets what was kept and makes sure the `reconcile` span is kept
    /// from now on, on a thread where this layer is the default. Call it
    /// once the span has run at least once (its callsite registered):
    /// tracing caches whether anyone wants a callsite when it is first
    /// hit, and a test on another thread (no subscriber) hitting it first
    /// while this is the only scoped subscriber caches "nobody" for good.
    /// Recomputing the cache here asks this thread's subscriber again.
    pub fn arm(&self) {
        tracing::callsite::rebuild_interest_cache();
        self.0.lock().unwrap().clear();
    }

    /// The `why` of every look at `key` by the reconciler of `kind` since
    /// the last call, oldest first (the rest is dropped).
    pub fn take_whys(&self, kind: &str, key: &str) -> Vec<String> {
        let prefix = format!("kind={kind} key={key} why=");
        self.take()
            .into_iter()
            .filter_map(|s| s.strip_prefix(&prefix).map(str::to_string))
            .collect()
    }

    /// Every span kept since the last call, as `kind=… key=… why=…`,
    /// oldest first.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}
