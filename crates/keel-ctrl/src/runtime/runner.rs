//! Runs due keys' reconciles, many at once but never two of one key: a VM
//! whose hypervisor call hangs holds up that VM only. After kube-rs'
//! runner: a key that becomes due while its reconcile runs is run again
//! once it has finished, at the earliest time asked for meanwhile.
//!
//! Each look runs in a `reconcile` span naming its kind, key and why it
//! ran ([`Why`]): what made it due soonest, and how many other triggers
//! coalesced into it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use async_trait::async_trait;
use keel_api::{Clock, Millis};
use tokio::task::{Id, JoinError, JoinSet};
use tracing::Instrument;

use super::event::Event;
use super::reason::{Reason, Why};
use super::reconciler::Reconciler;
use super::scheduler::Scheduler;
use crate::requeue::Requeue;
use crate::LifecycleObserver;

/// One reconciler's key: the reconciler by its place in the runner (so
/// keys of the first-added reconciler sort, and run, first on ties).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key {
    pub reconciler: usize,
    pub name: String,
}

/// A finished reconcile: when to look again, or, after a failure, after
/// how long to retry.
type Outcome = Result<Option<Requeue>, Millis>;

/// A reconciler with its error type erased, so one runner serves all.
#[async_trait]
trait AnyReconciler: Send + Sync {
    fn kind(&self) -> &'static str;
    fn triggers(&self, event: &Event) -> Vec<String>;
    async fn run(&self, key: &str, attempts: u32, why: &Why) -> Outcome;
}

struct Erased<R> {
    inner: Arc<R>,
    observer: Arc<dyn LifecycleObserver>,
}

#[async_trait]
impl<R: Reconciler> AnyReconciler for Erased<R> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn triggers(&self, event: &Event) -> Vec<String> {
        self.inner.triggers(event)
    }

    async fn run(&self, key: &str, attempts: u32, why: &Why) -> Outcome {
        let kind = self.inner.kind();
        let span = tracing::info_span!("reconcile", kind, key, why = %why);
        match self.inner.reconcile(key).instrument(span).await {
            Ok(next) => Ok(next),
            Err(err) => {
                tracing::warn!(kind, key, attempts, err = %crate::error_chain(&err), "reconcile failed");
                self.observer.reconcile_failed(kind);
                Err(self.inner.error_policy(&err, attempts))
            }
        }
    }
}

pub struct Runner {
    clock: Arc<dyn Clock>,
    observer: Arc<dyn LifecycleObserver>,
    reconcilers: Vec<Arc<dyn AnyReconciler>>,
    queue: Scheduler<Key>,
    /// Why each queued key is due.
    why: BTreeMap<Key, Why>,
    /// Keys whose reconcile is under way, with the earliest time each was
    /// asked for again meanwhile, and why.
    running: BTreeMap<Key, Option<(Millis, Why)>>,
    /// Failed looks in a row, per key, for the error policy.
    failures: BTreeMap<Key, u32>,
    tasks: JoinSet<(Key, Outcome)>,
    task_keys: HashMap<Id, Key>,
    max_concurrent: usize,
}

impl Runner {
    pub fn new(
        clock: Arc<dyn Clock>,
        observer: Arc<dyn LifecycleObserver>,
        max_concurrent: usize,
    ) -> Self {
        Self {
            clock,
            observer,
            reconcilers: Vec::new(),
            queue: Scheduler::default(),
            why: BTreeMap::new(),
            running: BTreeMap::new(),
            failures: BTreeMap::new(),
            tasks: JoinSet::new(),
            task_keys: HashMap::new(),
            max_concurrent: max_concurrent.max(1),
        }
    }

    pub fn add<R: Reconciler>(&mut self, reconciler: Arc<R>) {
        self.reconcilers.push(Arc::new(Erased {
            inner: reconciler,
            observer: self.observer.clone(),
        }));
    }

    /// The place of the reconciler of `kind`, if one was added.
    pub fn reconciler_of(&self, kind: &str) -> Option<usize> {
        self.reconcilers.iter().position(|r| r.kind() == kind)
    }

    /// Asks for `key` at `at` (earliest wins) for `reason`; if it runs
    /// now, it runs again after.
    pub fn schedule(&mut self, key: Key, at: Millis, reason: Reason) {
        self.enqueue(key, at, Why::new(reason));
    }

    fn enqueue(&mut self, key: Key, at: Millis, why: Why) {
        if let Some(again) = self.running.get_mut(&key) {
            match again {
                Some((t, held)) => {
                    held.merge(why, at < *t);
                    *t = (*t).min(at);
                }
                None => *again = Some((at, why)),
            }
            return;
        }
        let sooner = self.queue.due_at(&key).is_none_or(|t| at < t);
        self.queue.schedule(&key, at);
        match self.why.entry(key) {
            std::collections::btree_map::Entry::Occupied(mut held) => {
                held.get_mut().merge(why, sooner)
            }
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert(why);
            }
        }
    }

    /// Every key `event` triggers becomes due now.
    pub fn handle(&mut self, event: &Event) {
        let now = self.clock.now_ms();
        for reconciler in 0..self.reconcilers.len() {
            for name in self.reconcilers[reconciler].triggers(event) {
                self.schedule(Key { reconciler, name }, now, Reason::of(event));
            }
        }
    }

    /// Starts the reconciles of due keys, earliest first, as far as the
    /// concurrency bound allows; how many it started. Each runs as a task
    /// of its own, so nothing one reconcile waits for holds up another.
    pub fn start_due(&mut self) -> usize {
        let now = self.clock.now_ms();
        let mut started = 0;
        while self.tasks.len() < self.max_concurrent {
            let Some(key) = self.queue.pop_next_due(now) else {
                break;
            };
            let reconciler = self.reconcilers[key.reconciler].clone();
            let attempts = self.failures.get(&key).copied().unwrap_or(0) + 1;
            let why = self
                .why
                .remove(&key)
                .expect("every queued key has its reason");
            self.running.insert(key.clone(), None);
            let task_key = key.clone();
            let handle = self.tasks.spawn(async move {
                let outcome = reconciler.run(&task_key.name, attempts, &why).await;
                (task_key, outcome)
            });
            self.task_keys.insert(handle.id(), key);
            started += 1;
        }
        started
    }

    /// Takes in every reconcile that has finished, without waiting; how many.
    pub fn finish_ready(&mut self) -> usize {
        let mut finished = 0;
        while let Some(done) = self.tasks.try_join_next_with_id() {
            self.finish(done);
            finished += 1;
        }
        finished
    }

    /// Waits for the next reconcile to finish and takes it in (pending
    /// forever when none runs).
    pub async fn finish_next(&mut self) {
        match self.tasks.join_next_with_id().await {
            Some(done) => self.finish(done),
            None => std::future::pending().await,
        }
    }

    /// Waits for every running reconcile to finish.
    pub async fn finish_all(&mut self) {
        while let Some(done) = self.tasks.join_next_with_id().await {
            self.finish(done);
        }
    }

    fn finish(&mut self, done: Result<(Id, (Key, Outcome)), JoinError>) {
        let (key, outcome) = match done {
            Ok((id, (key, outcome))) => {
                self.task_keys.remove(&id);
                (key, outcome)
            }
            // A panicking reconcile is a bug: surface it as the old inline
            // loop did, rather than retry it forever.
            Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
            Err(err) => {
                let Some(key) = self.task_keys.remove(&err.id()) else {
                    return;
                };
                (key, Err(0))
            }
        };
        let again = self.running.remove(&key).flatten();
        let now = self.clock.now_ms();
        match outcome {
            Ok(next) => {
                self.failures.remove(&key);
                if let Some(Requeue { at, why }) = next {
                    let after_ms = at.saturating_sub(now);
                    self.schedule(key.clone(), at, Reason::Requeue { after_ms, why });
                }
            }
            Err(retry_in) => {
                let attempts = self.failures.entry(key.clone()).or_default();
                *attempts += 1;
                let reason = Reason::ErrorBackoff {
                    after_ms: retry_in,
                    attempts: *attempts,
                };
                self.schedule(key.clone(), now + retry_in, reason);
            }
        }
        if let Some((at, why)) = again {
            self.enqueue(key, at, why);
        }
    }

    /// When a queued key next needs starting; `None` while nothing is
    /// queued, or while the bound is reached (a finish wakes the driver).
    pub fn wake_at(&self) -> Option<Millis> {
        if self.tasks.len() >= self.max_concurrent {
            return None;
        }
        self.queue.next_due()
    }

    /// When `key` is queued for, if it is (not while it runs).
    pub fn due_at(&self, key: &Key) -> Option<Millis> {
        self.queue.due_at(key)
    }

    /// Reconciles under way.
    pub fn in_flight(&self) -> usize {
        self.tasks.len()
    }

    /// Whether `key`'s reconcile is under way.
    pub fn is_running(&self, key: &Key) -> bool {
        self.running.contains_key(key)
    }
}

// The integration tests' span capture, so both read spans alike.
#[cfg(test)]
#[path = "../../tests/support/reconcile_spans.rs"]
mod reconcile_spans;

#[cfg(test)]
mod tests {

    use keel_api::ManualClock;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;
    use crate::NoObserver;

    /// Looks at any key it is told of; "broken" fails, the rest ask to be
    /// looked at again in 100 ms.
    struct Asks {
        clock: Arc<ManualClock>,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("it broke")]
    struct Broke;

    #[async_trait]
    impl Reconciler for Asks {
        type Error = Broke;

        fn kind(&self) -> &'static str {
            "asks"
        }

        fn triggers(&self, event: &Event) -> Vec<String> {
            match event {
                Event::Domain(event) => vec![event.vm.clone()],
                Event::Changed { key } | Event::Listed { key } => vec![key.clone()],
            }
        }

        async fn reconcile(&self, key: &str) -> Result<Option<Requeue>, Broke> {
            if key == "broken" {
                return Err(Broke);
            }
            let at = self.clock.now_ms() + 100;
            Ok(Some(Requeue::at(at, "the fake waits")))
        }

        fn error_policy(&self, _err: &Broke, attempts: u32) -> Millis {
            250 * Millis::from(attempts)
        }
    }

    use super::reconcile_spans::ReconcileSpans as Spans;

    async fn run_due(runner: &mut Runner) {
        runner.start_due();
        runner.finish_all().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_reconcile_span_names_why_it_ran() {
        let spans = Spans::default();
        let _guard =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
        // Another test's thread may have met the span with no subscriber.
        spans.arm();
        let clock = Arc::new(ManualClock::new(1_000));
        let mut runner = Runner::new(clock.clone(), Arc::new(NoObserver), 4);
        runner.add(Arc::new(Asks {
            clock: clock.clone(),
        }));

        // Three triggers before the look: the first is named, the rest
        // counted.
        runner.handle(&Event::Changed { key: "a".into() });
        runner.handle(&Event::Listed { key: "a".into() });
        runner.handle(&Event::Changed { key: "a".into() });
        runner.handle(&Event::Listed { key: "b".into() });
        run_due(&mut runner).await;
        assert_eq!(
            spans.take(),
            [
                "kind=asks key=a why=object changed: a (and 2 more)",
                "kind=asks key=b why=listed: b",
            ]
        );

        // The time the look asked for, and why.
        clock.advance(100);
        run_due(&mut runner).await;
        assert_eq!(
            spans.take(),
            [
                "kind=asks key=a why=requeue after 100 ms: the fake waits",
                "kind=asks key=b why=requeue after 100 ms: the fake waits",
            ]
        );

        // A domain event makes the key due sooner than its requeue: it is
        // what is named.
        runner.handle(&Event::Domain(keel_hv::DomainEvent {
            vm: "a".into(),
            instance: "a-1".into(),
            kind: keel_hv::DomainEventKind::Exited,
        }));
        run_due(&mut runner).await;
        assert_eq!(
            spans.take(),
            ["kind=asks key=a why=domain event Exited of a-1 (and 1 more)"]
        );

        // A failed look is retried by the error policy, and says so.
        runner.handle(&Event::Changed {
            key: "broken".into(),
        });
        run_due(&mut runner).await;
        spans.take();
        clock.advance(250);
        run_due(&mut runner).await;
        let spans = spans.take();
        assert!(
            spans.contains(
                &"kind=asks key=broken why=error backoff after 250 ms (1 failed in a row)"
                    .to_string()
            ),
            "{spans:?}"
        );
    }
}
