//! Runs due keys' reconciles, many at once but never two of one key: a VM
//! whose hypervisor call hangs holds up that VM only. After kube-rs'
//! runner: a key that becomes due while its reconcile runs is run again
//! once it has finished, at the earliest time asked for meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use async_trait::async_trait;
use keel_api::{Clock, Millis};
use tokio::task::{Id, JoinError, JoinSet};

use super::event::Event;
use super::reconciler::Reconciler;
use super::scheduler::Scheduler;
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
type Outcome = Result<Option<Millis>, Millis>;

/// A reconciler with its error type erased, so one runner serves all.
#[async_trait]
trait AnyReconciler: Send + Sync {
    fn kind(&self) -> &'static str;
    fn triggers(&self, event: &Event) -> Vec<String>;
    async fn run(&self, key: &str, attempts: u32) -> Outcome;
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

    async fn run(&self, key: &str, attempts: u32) -> Outcome {
        let kind = self.inner.kind();
        match self.inner.reconcile(key).await {
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
    /// Keys whose reconcile is under way, with the earliest time each was
    /// asked for again meanwhile.
    running: BTreeMap<Key, Option<Millis>>,
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

    /// Asks for `key` at `at` (earliest wins); if it runs now, it runs
    /// again after.
    pub fn schedule(&mut self, key: Key, at: Millis) {
        match self.running.get_mut(&key) {
            Some(again) => *again = Some(again.map_or(at, |t| t.min(at))),
            None => self.queue.schedule(&key, at),
        }
    }

    /// Every key `event` triggers becomes due now.
    pub fn handle(&mut self, event: &Event) {
        let now = self.clock.now_ms();
        for reconciler in 0..self.reconcilers.len() {
            for name in self.reconcilers[reconciler].triggers(event) {
                self.schedule(Key { reconciler, name }, now);
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
            self.running.insert(key.clone(), None);
            let task_key = key.clone();
            let handle = self.tasks.spawn(async move {
                let outcome = reconciler.run(&task_key.name, attempts).await;
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
                if let Some(at) = next {
                    self.queue.schedule(&key, at);
                }
            }
            Err(retry_in) => {
                *self.failures.entry(key.clone()).or_default() += 1;
                self.queue.schedule(&key, now + retry_in);
            }
        }
        if let Some(at) = again {
            self.queue.schedule(&key, at);
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
